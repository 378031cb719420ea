"""How many decode forwards of mixed traffic replay a captured graph, per decoding mode.

    python benchmarks/graph_coverage.py                  # CPU: the static forwards, uncaptured
    python benchmarks/graph_coverage.py --device cuda    # captured CUDA graphs

Per mode, 16 requests with prompts of different lengths arrive staggered — the first at once,
then one more every ``--stagger`` forwards — into one engine with FlexAttention and graphs on,
at a seeded temperature > 0 (so acceptances, and with them the rows' token counts, vary from
step to step and request to request). The models are tiny random-weight checkpoints in each
family's real format: they never stop early, so all 16 requests overlap (the trained demos
answer in a few forwards and would rarely share one). On CPU the engine's runner runs the
static forwards uncaptured: the same padded forward, bucket rules and key a GPU captures and
replays.

A forward counts as a **decode** forward when none of its rows is its request's first forward
(the prefill of a new arrival; LLaDA's per-block refreshes of prompt and canvas count as
decode), and as **graphable** when it replayed a static forward
(``ModelRunner.last_graphed``: the bucket rules of ``GraphRunner.key_for`` and a static forward
for the key). All forwards are reported beside the decode ones. Writes
``benchmarks/results/graph_coverage[_cuda].json``:
``{"modes": {name: {"forwards": n, "graphable": m, ...}}}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PROMPTS, RESULTS_DIR, at_least, machine_info, write_json

from dllm_serve.config import EngineConfig
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.decoding.protocol import RowSpec
from dllm_serve.engine import engine as engine_module
from dllm_serve.engine.model_runner import ModelRunner
from dllm_serve.engine.outputs import RequestOutput
from dllm_serve.llm import LLM
from dllm_serve.models.loader import LoadedModel, load_model
from dllm_serve.models.lora import attach_draft_lora
from dllm_serve_train.tiny_checkpoints import write_tiny


class StaticRunner(ModelRunner):
    """The engine's runner with the static forwards on and uncaptured (CPU)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "cuda_graph": True, "capture": False})


Mode = tuple[LoadedModel, EngineConfig, DecodingParams]


def modes(root: Path, device: str) -> dict[str, Callable[[], Mode]]:
    """Each mode's model, engine settings and decoding parameters (seeded per request later),
    loaded when asked for."""
    dtype = "bfloat16" if device == "cuda" else "float32"
    sampled = {"temperature": 0.8}

    def load(name: str) -> LoadedModel:
        if name != "tiny-llada":  # tiny random checkpoints in the real formats
            name = str(write_tiny(name, root / name))
        return load_model(name, device=device, dtype=dtype)

    def trimode() -> LoadedModel:
        path = write_tiny("nemotron", root / "nemotron", block_size=8, seed=1,
                          draft_lora_out=root / "lora")  # fmt: skip
        loaded = load_model(str(path), device=device, dtype=dtype)
        attach_draft_lora(loaded.model, root / "lora")
        return loaded

    return {
        "llada prefix cache": lambda: (
            load("tiny-llada"),
            EngineConfig(kv_cache="prefix"),
            DecodingParams(gen_length=32, block_length=8, steps=16, **sampled),
        ),
        "idlm isd": lambda: (
            load("idlm"),
            EngineConfig(isd_stride=4),
            DecodingParams(gen_length=32, **sampled),
        ),
        "sdar blocks": lambda: (
            load("sdar"),
            EngineConfig(),
            DecodingParams(gen_length=32, **sampled),
        ),
        "llada2 blocks (MoE)": lambda: (
            load("llada2"),
            EngineConfig(),
            DecodingParams(gen_length=32, **sampled),
        ),
        "tri-mode linear_spec": lambda: (
            trimode(),
            EngineConfig(),
            DecodingParams(gen_length=32, decoding_mode="linear_spec", **sampled),
        ),
    }


def prompts(llm: LLM, n: int) -> list[list[int]]:
    """``n`` chat prompts of different lengths (the benchmarks' questions, some repeated with
    a longer preamble)."""
    out = []
    for i in range(n):
        question = PROMPTS[i % len(PROMPTS)]
        if i >= len(PROMPTS):
            question = "Please answer briefly. " * (1 + i % 3) + question
        out.append(llm.engine.chat_prompt_ids([{"role": "user", "content": question}]))
    return out


def replay(
    loaded: LoadedModel, config: EngineConfig, params: DecodingParams, n: int, stagger: int
) -> dict[str, Any]:
    """Serve ``n`` staggered requests; count forwards and graph replays."""
    config = dataclasses.replace(config, attention_backend="flex", cuda_graph=True,
                                 max_waiting_requests=64)  # fmt: skip
    if loaded.device.type == "cpu":  # the engine turns graphs on for CUDA only
        engine_module.ModelRunner = StaticRunner  # type: ignore[misc]
    counts = {"forwards": 0, "graphable": 0, "all_forwards": 0, "all_graphable": 0}
    rows_per_forward: list[int] = []
    eager_tokens: list[int] = []  # tokens of the decode forwards that ran eagerly
    seen: set[int] = set()
    held: list[Any] = []
    done = threading.Event()
    finished = [0]
    errors: list[str] = []
    try:
        with LLM.from_loaded(loaded, config) as llm:
            engine, runner = llm.engine, llm.engine.runner
            if runner.graphs is None:
                raise SystemExit(f"{loaded.name}: graphs are off for this model")
            pending = [
                (ids, dataclasses.replace(params, seed=i)) for i, ids in enumerate(prompts(llm, n))
            ]

            def sink(output: RequestOutput) -> None:
                if output.finished:
                    if output.error is not None:
                        errors.append(str(output.error))
                    finished[0] += 1
                    if finished[0] == n:
                        done.set()

            def submit_next() -> None:
                ids, p = pending.pop(0)
                engine.submit(ids, p, sink, final_only=True)

            original = runner.run

            def counting_run(rows: list[RowSpec]) -> Any:
                logits = original(rows)
                # A request's first forward (its prefill) is the first that holds its pages.
                first = [r.kv is None or id(r.kv) not in seen for r in rows]
                seen.update(id(r.kv) for r in rows)
                held.extend(r.kv for r in rows)  # ids stay unique while the pages objects live
                decode = not any(first)
                counts["all_forwards"] += 1
                counts["all_graphable"] += runner.last_graphed
                counts["forwards"] += decode
                counts["graphable"] += decode and runner.last_graphed
                if decode and not runner.last_graphed:
                    eager_tokens.append(sum(len(r.tokens) for r in rows))
                rows_per_forward.append(len(rows))
                if pending and counts["all_forwards"] % stagger == 0:
                    submit_next()  # on the engine thread: admitted at the next step
                return logits

            runner.run = counting_run  # type: ignore[method-assign]
            started = time.perf_counter()
            submit_next()
            if not done.wait(timeout=1800):
                raise SystemExit(f"{loaded.name}: timed out")
            if errors:
                raise SystemExit(f"{loaded.name}: {len(errors)} request(s) failed: {errors[0]}")
            seconds = time.perf_counter() - started
            graphs = runner.graphs
            keys = sorted((k.tokens, k.logits) for k in graphs.graphs)
            failed = len(graphs.failed)
    finally:
        engine_module.ModelRunner = ModelRunner  # type: ignore[misc]
    return {
        **counts,
        "graphable_share": round(counts["graphable"] / max(1, counts["forwards"]), 3),
        "max_rows_per_forward": max(rows_per_forward),
        "mean_rows_per_forward": round(sum(rows_per_forward) / len(rows_per_forward), 2),
        "graph_keys_used": keys,
        "eager_decode_forward_tokens": sorted(eager_tokens),
        "captures_failed": failed,
        "seconds": round(seconds, 1),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=at_least(1), default=16)
    parser.add_argument("--stagger", type=at_least(1), default=1, help="forwards between arrivals")
    parser.add_argument("--only", nargs="*", help="mode names (default: all)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(min(2, torch.get_num_threads()))
    report: dict[str, Any] = {
        "benchmark": "graph_coverage",
        "machine": machine_info(),
        "device": args.device,
        "captured": args.device == "cuda",
        "requests": args.requests,
        "stagger_forwards": args.stagger,
        "modes": {},
    }
    with tempfile.TemporaryDirectory() as root:
        table = modes(Path(root), args.device)
        unknown = set(args.only or ()) - set(table)
        if unknown:
            parser.error(f"unknown mode(s) {sorted(unknown)}: choose from {sorted(table)}")
        for name, make in table.items():
            if args.only and name not in args.only:
                continue
            loaded, config, params = make()
            result = replay(loaded, config, params, args.requests, args.stagger)
            report["modes"][name] = result
            print(f"{name:24s} decode forwards {result['graphable']}/{result['forwards']} "
                  f"graphable ({result['graphable_share']:.0%}); all forwards "
                  f"{result['all_graphable']}/{result['all_forwards']}; "
                  f"mean rows {result['mean_rows_per_forward']}", flush=True)  # fmt: skip
    suffix = "" if args.device == "cpu" else f"_{args.device}"
    out = args.out or RESULTS_DIR / f"graph_coverage{suffix}.json"
    print(write_json(out, report))


if __name__ == "__main__":
    main()
