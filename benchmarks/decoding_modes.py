"""Forward passes (NFE) per answer token for each decoding mode, without and with KV cache.

    python benchmarks/decoding_modes.py            # demo-llada on CPU, writes JSON
    python benchmarks/decoding_modes.py --model /models/LLaDA-8B-Instruct --device cuda
    python benchmarks/decoding_modes.py --kv-cache none   # skip the prefix-cache runs

Runs every prompt alone through ``LLaDADenoiser`` exactly as the engine steps it (prepare →
``ModelRunner.run`` → sample → one ``.tolist()`` → commit; with the prefix cache the request
holds a span of the runner's KV pool, sized as the engine sizes it), greedy, with the model's
stop ids (so the exact EOS early stop is included), and writes
``benchmarks/results/decoding_modes.json``.
With the embedded ``tiny-llada`` (random weights) the model is never confident, so the
numbers only show each mode's floor/ceiling; they become meaningful with a trained model.

Each mode runs with ``--kv-cache none`` and ``prefix`` side by side (same process, same
prompts): NFE, wall time per forward, tokens fed per forward, and how many answer-region
canvas positions the cached run decoded to the same token as the exact one (agreement).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PROMPTS, at_least

from dllm_serve.decoding.blocks import DenoiseState
from dllm_serve.decoding.canvas import LLaDADenoiser
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.decoding.protocol import RowSpec
from dllm_serve.engine.model_runner import ModelRunner
from dllm_serve.models.kv_pool import PAGE_SIZE
from dllm_serve.models.loader import load_model

MODES: dict[str, dict] = {
    "uniform": {"block_schedule": "uniform"},
    "cosine": {"block_schedule": "cosine"},
    "front_loaded": {"block_schedule": "front_loaded"},
    "threshold_0.9": {"confidence_threshold": 0.9},
    "local_leap_default": {"use_local_leap": True},
}
RESULTS = Path(__file__).resolve().parent / "results" / "decoding_modes.json"


def sync(device: torch.device) -> None:
    """Wait for queued kernels: wall times on CUDA are meaningless without it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def init(
    runner: ModelRunner, denoiser: LLaDADenoiser, ids: list[int], params: DecodingParams
) -> DenoiseState:
    """A request's state, with its KV span when the denoiser keeps a prefix cache."""
    state = denoiser.init_state(ids, params, runner.device)
    need = denoiser.kv_tokens(len(ids), params)
    if need:
        assert runner.pool is not None
        state.kv = runner.pool.reserve(need)
        if state.kv is None:
            raise RuntimeError(f"the KV pool has no room for {need} slots")
    return state


def release(runner: ModelRunner, state: DenoiseState) -> None:
    if state.kv is not None:
        assert runner.pool is not None
        runner.pool.free(state.kv)
        state.kv = None


@torch.inference_mode()  # as the engine's loop: the sampler may work on the logits in place
def step(runner: ModelRunner, denoiser: LLaDADenoiser, state: DenoiseState) -> RowSpec:
    """One engine step of a one-row batch; returns the row it forwarded."""
    spec = denoiser.prepare(state)
    logits = runner.run([spec])
    # The step's one device→host copy, as in the engine.
    denoiser.commit([state], denoiser.sample([state], logits).tolist())
    return spec


def run_one(
    runner: ModelRunner, denoiser: LLaDADenoiser, ids: list[int], params: DecodingParams
) -> dict:
    state = init(runner, denoiser, ids, params)
    fed = 0
    try:
        while not state.finished:
            fed += len(step(runner, denoiser, state).tokens)
    finally:
        release(runner, state)
    return {
        "canvas": state.tokens[len(ids) :],
        "fed_tokens": fed,
        "nfe": state.nfe,
        "committed": state.committed,
        "answer_tokens": len(state.answer_tokens()),
        "finish_reason": state.finish_reason,
    }


def forward_timing(
    runner: ModelRunner, prefix: LLaDADenoiser, ids: list[int], params: DecodingParams
) -> dict:
    """One full-canvas forward vs one cached forward of the same step, best of many.

    Mid-canvas (the block at the middle): the refresh forward of that block is replayed as
    the full forward (without a KV span: it writes nothing), the block's second step as the
    cached one (it rewrites only the K/V past the cached prefix, which the request does not
    keep, so every call is the same forward). Each call is ``ModelRunner.run`` (packing the
    row included), synchronised on CUDA.
    """
    # The forwards' cost does not depend on what they commit: EOS is ignored so that a trained
    # model's early stop cannot end the request before the middle block (found by QA: a
    # crash on the default demo-llada, which answers within the first block).
    state = init(runner, prefix, ids, dataclasses.replace(params, ignore_eos=True))
    try:
        while state.block < params.num_blocks // 2 or state.step < 1:
            step(runner, prefix, state)
        cached = prefix.prepare(state)
        full = RowSpec(
            tokens=state.tokens,
            start=0,
            logits_at=[i + cached.start for i in cached.logits_at],
            attention=cached.attention,
        )
        best = {}
        for name, spec in (("full", full), ("cached", cached)):
            times = []
            for _ in range(50):
                sync(runner.device)
                start = time.perf_counter()
                runner.run([spec])
                sync(runner.device)
                times.append(time.perf_counter() - start)
            best[name] = {
                "tokens": len(spec.tokens),
                "ms_best_of_50": round(min(times) * 1e3, 3),
            }
    finally:
        release(runner, state)
    return best


def summarise(
    name: str, mode: dict, kv: str, runs: list[dict], seconds: float, exact: list[dict] | None
) -> dict:
    nfe = sum(r["nfe"] for r in runs)
    committed = sum(r["committed"] for r in runs)
    answer = sum(r["answer_tokens"] for r in runs)
    agreement = None
    if exact is not None:  # answer-region positions decoded to the same token as `none`
        same = sum(
            sum(a == b for a, b in zip(r["canvas"], e["canvas"], strict=True))
            for r, e in zip(runs, exact, strict=True)
        )
        total = sum(len(e["canvas"]) for e in exact)
        identical = sum(r["canvas"] == e["canvas"] for r, e in zip(runs, exact, strict=True))
        agreement = {"positions": round(same / total, 3), "identical_answers": identical}
    return {
        "mode": name,
        "kv_cache": kv,
        "params": mode,
        "nfe_total": nfe,
        "committed_total": committed,
        "answer_tokens_total": answer,
        "nfe_per_answer_token": round(nfe / answer, 3) if answer else None,
        "nfe_per_canvas_token": round(nfe / committed, 3) if committed else None,
        "tokens_per_forward": round(committed / nfe, 3) if nfe else None,
        "fed_tokens_per_forward": round(sum(r["fed_tokens"] for r in runs) / nfe, 1),
        "seconds": round(seconds, 3),
        "ms_per_forward": round(1000 * seconds / nfe, 2),
        "agreement_with_none": agreement,
        "per_prompt": runs,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo-llada")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--gen-length", type=at_least(1), default=64)
    parser.add_argument("--block-length", type=at_least(1), default=16)
    parser.add_argument("--steps", type=at_least(1), default=32, help="fixed-step modes only")
    parser.add_argument("--kv-cache", choices=["none", "prefix", "both"], default="both")
    parser.add_argument("--repeat", type=at_least(1), default=1, help="time: best of N runs")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    loaded = load_model(args.model, device=args.device)
    caches = ["none", "prefix"] if args.kv_cache == "both" else [args.kv_cache]
    denoisers = {
        kv: LLaDADenoiser(
            loaded.mask_id,
            loaded.stop_ids,
            logit_shift=loaded.family.logit_shift,
            bidirectional=loaded.family.bidirectional,
            prefix_cache=kv == "prefix",
        )
        for kv in caches
    }
    prompts = [loaded.chat_prompt_ids([{"role": "user", "content": p}]) for p in PROMPTS]
    # One request at a time: the pool holds one span of the longest prompt's canvas.
    longest = max(map(len, prompts)) + max(args.gen_length, 8)
    slots = -(-longest // PAGE_SIZE) * PAGE_SIZE if "prefix" in denoisers else 0
    runner = ModelRunner(loaded.model, loaded.device, kv_slots=slots)
    run_one(runner, denoisers[caches[0]], prompts[0], DecodingParams(gen_length=8, steps=8))
    rows = []
    for name, mode in MODES.items():
        params = DecodingParams(
            gen_length=args.gen_length, block_length=args.block_length, steps=args.steps, **mode
        )
        # Prompt by prompt, every cache setting back to back, best of --repeat: background
        # load on a shared machine then hits the settings alike.
        runs: dict[str, list[dict]] = {kv: [] for kv in denoisers}
        seconds = dict.fromkeys(denoisers, 0.0)
        for ids in prompts:
            for kv, denoiser in denoisers.items():
                best = float("inf")
                for _ in range(args.repeat):
                    sync(loaded.device)
                    start = time.perf_counter()
                    run = run_one(runner, denoiser, ids, params)
                    best = min(best, time.perf_counter() - start)
                runs[kv].append(run)
                seconds[kv] += best
        for kv in denoisers:  # `none` first: the others compare with it
            exact = runs.get("none") if kv != "none" else None
            rows.append(summarise(name, mode, kv, runs[kv], seconds[kv], exact))
            r = rows[-1]
            print(
                f"{name:20s} {kv:6s} NFE {r['nfe_total']:5d}  answer {r['answer_tokens_total']:4d}"
                f"  NFE/answer token {r['nfe_per_answer_token']}  tok/fwd "
                f"{r['tokens_per_forward']}  ms/fwd {r['ms_per_forward']}  fed/fwd "
                f"{r['fed_tokens_per_forward']}  agreement {r['agreement_with_none']}"
            )
    timing = None
    if "prefix" in denoisers:
        params = DecodingParams(
            gen_length=args.gen_length, block_length=args.block_length, steps=args.steps
        )
        timing = forward_timing(runner, denoisers["prefix"], prompts[0], params)
        print(f"one forward, mid-canvas: {timing}")
    for row in rows:  # the canvases were only kept for the agreement
        for run in row["per_prompt"]:
            del run["canvas"]
    report = {
        "model": loaded.name,
        "random_weights": args.model == "tiny-llada",
        "device": str(loaded.device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "gen_length": args.gen_length,
        "block_length": args.block_length,
        "steps_fixed_modes": args.steps,
        "kv_cache": caches,
        "timing": f"best of {args.repeat} per prompt, settings interleaved",
        "temperature": 0.0,
        "prompts": len(prompts),
        "modes": rows,
        "forward_timing": timing,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
