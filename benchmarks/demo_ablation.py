"""Decoding ablation on the trained demo models: accuracy against forward passes.

    python benchmarks/demo_ablation.py                       # both demo models, CPU
    python benchmarks/demo_ablation.py --n-addition 50 --n-other 10 --only llada

For the LLaDA demo: exact-match accuracy on held-out questions and forward passes (NFE) per
answer token for the baseline (the model's defaults: canvas 32, 32 steps, one block), each
schedule, fewer steps, semi-autoregressive blocks, threshold decoding, a LocalLeap κ/τ sweep,
each of the main settings with the prefix KV cache off and on. For the I-DLM demo:
self-speculative decoding at strides 2/4/8 against stride 1 (plain autoregressive): tokens
per forward, draft acceptance rate, accuracy. Every setting runs through the serving engine
(``dllm_serve.LLM``, batched as the server batches) at temperature 0 on the same questions.
NFE counts every forward a request took part in; answer tokens exclude EOS padding.
Writes ``benchmarks/results/demo_ablation.json`` (+ ``.png`` with matplotlib).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    RESULTS_DIR,
    add_threads_option,
    apply_threads,
    at_least,
    machine_info,
    plot_if_available,
    write_json,
)

from dllm_serve.config import EngineConfig
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.llm import LLM
from dllm_serve_train.tasks import TASKS, held_out_set

CANVAS = 32
LLADA_SETTINGS: dict[str, dict[str, Any]] = {
    "baseline (uniform, 32 steps)": {},
    "cosine schedule": {"block_schedule": "cosine"},
    "front_loaded schedule": {"block_schedule": "front_loaded"},
    "16 steps": {"steps": 16},
    "8 steps": {"steps": 8},
    "blocks of 8": {"block_length": 8},
    "threshold 0.9": {"confidence_threshold": 0.9},
    "threshold 0.7": {"confidence_threshold": 0.7},
    "threshold 0.5": {"confidence_threshold": 0.5},
    "LocalLeap κ0.9 τ0.75 (default)": {"use_local_leap": True},
    "LocalLeap κ0.9 τ0.5": {"use_local_leap": True, "local_leap_neighbor_threshold": 0.5},
    "LocalLeap κ0.8 τ0.6": {
        "use_local_leap": True,
        "local_leap_anchor_threshold": 0.8,
        "local_leap_neighbor_threshold": 0.6,
    },
    "LocalLeap κ0.7 τ0.5": {
        "use_local_leap": True,
        "local_leap_anchor_threshold": 0.7,
        "local_leap_neighbor_threshold": 0.5,
    },
}
# Settings also measured with the prefix KV cache (Fast-dLLM): the cache is approximate.
WITH_PREFIX_CACHE = (
    "baseline (uniform, 32 steps)",
    "blocks of 8",
    "threshold 0.9",
    "LocalLeap κ0.9 τ0.75 (default)",
)
ISD_STRIDES = (1, 2, 4, 8)


def questions(n_addition: int, n_other: int) -> list:
    return [
        ex
        for task in TASKS
        for ex in held_out_set(n_addition if task == "addition" else n_other, task=task)
    ]


def measure(llm: LLM, exs: list, params: DecodingParams) -> dict[str, Any]:
    start = time.perf_counter()
    outs = llm.generate([[{"role": "user", "content": e.question}] for e in exs], params)
    seconds = time.perf_counter() - start
    by_task: dict[str, list[bool]] = {}
    for e, o in zip(exs, outs, strict=True):
        by_task.setdefault(e.task, []).append(o.text.strip() == e.answer)
    nfe = sum(o.nfe for o in outs)
    answer = sum(o.completion_tokens for o in outs)
    drafted = sum(o.drafted for o in outs)
    return {
        "addition_accuracy": round(sum(by_task["addition"]) / len(by_task["addition"]), 4),
        "accuracy_by_task": {t: round(sum(v) / len(v), 4) for t, v in by_task.items()},
        "nfe_total": nfe,
        "answer_tokens": answer,
        "nfe_per_answer_token": round(nfe / answer, 3) if answer else None,
        "answer_tokens_per_forward": round(answer / nfe, 3) if nfe else None,
        "canvas_tokens_per_forward": round(sum(o.committed for o in outs) / nfe, 3)
        if nfe
        else None,
        "drafted": drafted,
        "acceptance_rate": round(sum(o.accepted_drafts for o in outs) / drafted, 4)
        if drafted
        else None,
        "seconds": round(seconds, 2),
    }


def llada_rows(model: str, exs: list, device: str) -> list[dict[str, Any]]:
    rows = []
    for kv in ("none", "prefix"):
        config = EngineConfig(max_running_requests=64, max_waiting_requests=1 << 20, kv_cache=kv)
        with LLM(model, device=device, engine_config=config) as llm:
            for name, setting in LLADA_SETTINGS.items():
                if kv == "prefix" and name not in WITH_PREFIX_CACHE:
                    continue
                params = DecodingParams(**{"gen_length": CANVAS, "steps": CANVAS, **setting})
                row = {"setting": name, "kv_cache": kv, "params": setting}
                row |= measure(llm, exs, params)
                rows.append(row)
                print(_line(row), flush=True)
    return rows


def idlm_rows(model: str, exs: list, device: str) -> list[dict[str, Any]]:
    rows = []
    for stride in ISD_STRIDES:
        config = EngineConfig(
            max_running_requests=64, max_waiting_requests=1 << 20, isd_stride=stride
        )
        with LLM(model, device=device, engine_config=config) as llm:
            row = {"setting": f"stride {stride}" + (" (autoregressive)" if stride == 1 else "")}
            row |= {"kv_cache": "per-request (exact)", "params": {"isd_stride": stride}}
            row |= measure(llm, exs, DecodingParams(gen_length=CANVAS, steps=CANVAS))
            rows.append(row)
            print(_line(row), flush=True)
    return rows


def _line(row: dict[str, Any]) -> str:
    extra = f" acceptance {row['acceptance_rate']}" if row["acceptance_rate"] is not None else ""
    return (
        f"{row['setting']:34s} {row['kv_cache']:8s} addition {row['addition_accuracy']:.3f}"
        f"  NFE/answer token {row['nfe_per_answer_token']}"
        f"  answer tok/fwd {row['answer_tokens_per_forward']}{extra}  {row['seconds']} s"
    )


def plot(report: dict[str, Any], path: Path) -> None:
    def draw(plt: Any) -> None:
        fig, ax = plt.subplots(figsize=(9, 6))
        for family, marker in (("llada", "o"), ("idlm", "s")):
            for row in report.get(family, []):
                ax.scatter(row["nfe_per_answer_token"], row["addition_accuracy"], marker=marker)
                label = f"{family}: {row['setting']}" + (
                    " +cache" if row["kv_cache"] == "prefix" else ""
                )
                ax.annotate(
                    label, (row["nfe_per_answer_token"], row["addition_accuracy"]), fontsize=6
                )
        ax.set_xlabel("forward passes per answer token (lower is faster)")
        ax.set_ylabel("held-out addition exact match")
        ax.set_title("Demo models: accuracy vs forward passes (temperature 0)")
        fig.tight_layout()

    plot_if_available(path, draw)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llada", default="demo-llada")
    p.add_argument("--idlm", default="demo-idlm")
    p.add_argument("--only", choices=["llada", "idlm"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--n-addition", type=at_least(1), default=300)
    p.add_argument("--n-other", type=at_least(1), default=40)
    add_threads_option(p)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "demo_ablation.json")
    args = p.parse_args(argv)
    apply_threads(args.threads)
    exs = questions(args.n_addition, args.n_other)
    report: dict[str, Any] = {
        "machine": machine_info(),
        "questions": {"addition": args.n_addition, "each other task": args.n_other},
        "canvas": CANVAS,
        "temperature": 0.0,
    }
    if args.only != "idlm":
        report["llada_model"] = args.llada
        report["llada"] = llada_rows(args.llada, exs, args.device)
    if args.only != "llada":
        report["idlm_model"] = args.idlm
        report["idlm"] = idlm_rows(args.idlm, exs, args.device)
    write_json(args.out, report)
    plot(report, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
