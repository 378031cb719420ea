"""demo-trimode's three decoding modes through a real server, side by side.

    python benchmarks/trimode_modes.py               # 25 questions per set
    python benchmarks/trimode_modes.py --n 100

Two servers are started with the real CLI: ``demo-trimode`` alone, then with its draft LoRA
(``--draft-lora demo-trimode-lora``). Every held-out question goes through
``/v1/chat/completions`` with the ``openai`` SDK at temperature 0, once per
``decoding_mode`` (``ar``, ``diffusion`` at the defaults — top-k, one token per step — and
with ``confidence_threshold: 0.9``, ``linear_spec``; with the LoRA, ``ar`` and ``linear_spec``).
Reported per mode: exact match per set, forwards per answer token
(``usage.diffusion.nfe`` over ``usage.completion_tokens``, summed over all questions; the
prefill counts), drafted/accepted drafts, and how many answers equal ``ar``'s — LinearSpec is
exact at T = 0, so that must be all of them. The headline ratio is ``ar``'s forwards per
answer token over LinearSpec's, measured in the same run. Writes
``benchmarks/results/trimode_modes.json``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS_DIR, at_least, machine_info, write_json
from demo_accuracy import question_sets

from dllm_serve.local_server import LocalServer
from dllm_serve_train.tasks import Example

# A row of the report → the request's extension fields (the name is the decoding mode unless
# listed here).
VARIANTS: dict[str, dict[str, Any]] = {
    "diffusion+threshold": {"decoding_mode": "diffusion", "confidence_threshold": 0.9},
}


def ask(client: openai.OpenAI, ex: Example, mode: str) -> dict[str, Any]:
    reply = client.chat.completions.create(
        model="demo-trimode",
        messages=[{"role": "user", "content": ex.question}],
        temperature=0,
        extra_body=VARIANTS.get(mode, {"decoding_mode": mode}),
    )
    usage = reply.model_dump()["usage"]
    diffusion = usage.get("diffusion") or {}
    return {
        "text": reply.choices[0].message.content or "",
        "tokens": usage["completion_tokens"],
        "nfe": diffusion.get("nfe", 0),
        "drafted": diffusion.get("drafted_tokens", 0),
        "accepted": diffusion.get("accepted_drafts", 0),
    }


def run_server(
    flags: list[str], modes: list[str], sets: dict[str, list[Example]], workers: int
) -> dict[str, dict[str, Any]]:
    log = Path(tempfile.mkdtemp()) / "server.log"
    server = LocalServer.start(["--model", "demo-trimode", *flags, "--log-level", "warning"], log)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=600)
    questions = [e for exs in sets.values() for e in exs]
    out: dict[str, dict[str, Any]] = {}
    try:
        for mode in modes:
            with ThreadPoolExecutor(workers) as pool:
                replies = list(pool.map(lambda e, m=mode: ask(client, e, m), questions))
            accuracy, start = {}, 0
            for name, exs in sets.items():
                got = replies[start : start + len(exs)]
                right = sum(g["text"].strip() == e.answer for g, e in zip(got, exs, strict=True))
                accuracy[name] = round(right / len(exs), 4)
                start += len(exs)
            tokens = sum(r["tokens"] for r in replies)
            forwards = sum(r["nfe"] for r in replies)
            out[mode] = {
                "accuracy": accuracy,
                "answer_tokens": tokens,
                "forwards": forwards,
                "forwards_per_token": round(forwards / max(tokens, 1), 4),
                "drafted": sum(r["drafted"] for r in replies),
                "accepted": sum(r["accepted"] for r in replies),
                "texts": [r["text"] for r in replies],
            }
            print(mode, flags, out[mode]["forwards_per_token"], accuracy, flush=True)
    finally:
        server.stop()
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--n", type=at_least(1), default=25, help="questions per addition stratum")
    p.add_argument("--n-other", type=at_least(1), default=25, help="questions per other task")
    p.add_argument("--workers", type=at_least(1), default=16, help="concurrent requests")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "trimode_modes.json")
    args = p.parse_args(argv)
    sets = question_sets(args.n, args.n_other)
    plain = run_server(
        [], ["ar", "diffusion", "diffusion+threshold", "linear_spec"], sets, args.workers
    )
    lora = run_server(
        ["--draft-lora", "demo-trimode-lora"], ["ar", "linear_spec"], sets, args.workers
    )
    modes = {**plain, "ar+lora": lora["ar"], "linear_spec+lora": lora["linear_spec"]}
    ar_texts = plain["ar"]["texts"]
    for result in modes.values():
        texts = result.pop("texts")
        result["same_as_ar"] = sum(a == b for a, b in zip(texts, ar_texts, strict=True))
    ar = plain["ar"]["forwards_per_token"]
    report = {
        "questions": len(ar_texts),
        "modes": modes,
        "ar_over_linear_spec": round(ar / modes["linear_spec"]["forwards_per_token"], 3),
        "ar_over_linear_spec_lora": round(ar / modes["linear_spec+lora"]["forwards_per_token"], 3),
        "machine": machine_info(),
        "command": " ".join(sys.argv),
    }
    write_json(args.out, report)


if __name__ == "__main__":
    main()
