"""The demo models' held-out accuracy through a real server, at the server's defaults.

    python benchmarks/demo_accuracy.py                      # both demos, canvases 32/256/1024
    python benchmarks/demo_accuracy.py --only llada --n 40  # a quick look

What a user gets: each demo is started with the real CLI (``python -m dllm_serve --model
demo-…``) and every question goes through ``/v1/chat/completions`` with the ``openai`` SDK at
temperature 0, with no other field than ``max_tokens`` (and once without it: the model's own
default canvas). Scored per addition stratum (operand digit counts 1+1, 2+2, mixed, 3+3; the
1+1 stratum is every held-out one-digit pair, ``What is 2 + 2?`` among them) and per task,
on the held-out questions (never trained on). Also reported: for each question, whether the
answers at every canvas are the same text. Writes
``benchmarks/results/demo_accuracy_<model>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    RESULTS_DIR,
    add_demo_options,
    at_least,
    demo_families,
    machine_info,
    write_json,
)

from dllm_serve.local_server import LocalServer
from dllm_serve.models.hub import EMBEDDED_MODELS
from dllm_serve_train.tasks import STRATA, Example, held_out_additions, held_out_set

TASKS = ("reverse_word", "reverse", "reverse_long", "sort_word", "sort", "count", "lookup")


def trained_tasks(model: str) -> tuple[str, ...]:
    """The tasks of :data:`TASKS` that ``model``'s training report gives a weight (all of
    them when it has no report): a task the model was not trained on is not measured."""
    path = Path(EMBEDDED_MODELS.get(model, model)) / "training_report.json"
    if not path.is_file():
        return TASKS
    weights = json.loads(path.read_text()).get("task_weights") or {}
    return tuple(t for t in TASKS if weights.get(t))


def question_sets(n: int, n_other: int, tasks: tuple[str, ...] = TASKS) -> dict[str, list[Example]]:
    sets = {f"addition_{s}": held_out_additions(s, n) for s in STRATA}
    sets |= {t: held_out_set(n_other, task=t) for t in tasks}
    return sets


def ask_all(
    client: openai.OpenAI, exs: list[Example], max_tokens: int | None, workers: int
) -> list[str]:
    def ask(ex: Example) -> str:
        extra: dict[str, Any] = {} if max_tokens is None else {"max_tokens": max_tokens}
        reply = client.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": ex.question}],
            temperature=0,
            **extra,
        )
        return reply.choices[0].message.content or ""

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(ask, exs))


def run_model(model: str, canvases: list[int | None], n: int, n_other: int, workers: int) -> dict:
    sets = question_sets(n, n_other, trained_tasks(model))
    log = Path(tempfile.mkdtemp()) / "server.log"
    server = LocalServer.start(["--model", model, "--log-level", "warning"], log)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=600)
    results: dict[str, Any] = {"model": model, "accuracy": {}, "seconds": {}}
    answers: dict[str, dict[str, list[str]]] = {}
    try:
        for canvas in canvases:
            key = "default" if canvas is None else str(canvas)
            started = time.monotonic()
            scores = {}
            for name, exs in sets.items():
                got = ask_all(client, exs, canvas, workers)
                answers.setdefault(name, {})[key] = got
                right = sum(a.strip() == e.answer for a, e in zip(got, exs, strict=True))
                scores[name] = {
                    "right": right,
                    "of": len(exs),
                    "accuracy": round(right / len(exs), 4),
                }
            results["accuracy"][key] = scores
            results["seconds"][key] = round(time.monotonic() - started, 1)
            print(model, key, {k: v["accuracy"] for k, v in scores.items()}, flush=True)
    finally:
        server.stop()
    same, total = 0, 0
    for by_canvas in answers.values():
        for texts in zip(*by_canvas.values(), strict=True):
            total += 1
            same += len(set(texts)) == 1
    results["same_answer_at_every_canvas"] = {"questions": total, "same": same}
    results["examples"] = {
        name: [
            {"question": e.question, "expected": e.answer, **{k: v[i] for k, v in by.items()}}
            for i, e in enumerate(sets[name][:3])
        ]
        for name, by in answers.items()
    }
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--n", type=at_least(1), default=250, help="questions per addition stratum")
    p.add_argument("--n-other", type=at_least(1), default=100, help="questions per other task")
    p.add_argument("--canvases", default="default,32,256,1024")
    p.add_argument("--workers", type=at_least(1), default=32, help="concurrent requests")
    add_demo_options(p, ("llada", "idlm"))
    args = p.parse_args()
    families = demo_families(p, args, ("llada", "idlm"))
    canvases = [None if c == "default" else int(c) for c in args.canvases.split(",")]
    for family in families:
        model = str(args.model_path) if args.model_path else f"demo-{family}"
        result = run_model(model, canvases, args.n, args.n_other, args.workers)
        result["machine"] = machine_info()
        result["command"] = " ".join(sys.argv)
        write_json(args.out or RESULTS_DIR / f"demo_accuracy_demo-{family}.json", result)


if __name__ == "__main__":
    main()
