"""LLaDA-8B-sized forward latency on a GPU vs the memory-bandwidth bound of its weights.

    python benchmarks/gpu_llada8b.py                          # on a machine with CUDA
    python benchmarks/gpu_llada8b.py --batches 1 16 --prefix 512 --block 32 --iters 20
    python benchmarks/gpu_llada8b.py --allow-cpu --tiny       # smoke path (the unit test)

A random-weight ``DecoderTransformer`` with the shape of LLaDA-8B-Instruct (the config in
``tests/fixtures/llada-8b-instruct/config.json`` through the llada family's
``transformer_config``) is built on the meta device (q/k/v and gate/up already fused, as the
serving :class:`ModelRunner` runs it), materialised directly in bf16 on the GPU and filled with
random values: no checkpoint is read or written. The forwards go through the serving runtime:
each row is a :class:`RowSpec`, one :class:`ModelRunner` (with a :class:`KVPool` holding a span
of prefix + block slots per row) packs them into a flat batch. For each batch size it times:

- ``no_cache``: one bidirectional forward over prefix + block (what a step costs without a KV
  cache: the whole sequence is recomputed), LM head at the block's positions;
- ``prefix_refresh``: the same forward with each row's KV span, writing the K/V of all
  prefix + block tokens to the pool (the first step of a block with the Fast-dLLM prefix cache);
- ``prefix_cache``: one forward over the block only, reading the prefix's K/V from the pool
  (a cached step: the prefix is filled once beforehand by a refresh; the block's own K/V are
  rewritten with the same values at every call, so every call is the same forward).

The headline ``latency_ms_*`` time ``ModelRunner.forward`` on a prebuilt :class:`FlatBatch`
(the eager model and LM head, CUDA synchronised before and after each call); ``run_ms_median``
times ``ModelRunner.run`` on the rows (host packing + host→device copy + forward), what an
engine step pays before sampling — for ``prefix_cache`` rows that is a CUDA graph replay
(``run_replayed_graph``; ``--no-cuda-graph`` keeps it eager); ``runner_forward_ms_median`` is
the runner's own ``forward_seconds()`` (CUDA events around the kernels, what the server's
``dllm:forward_duration_seconds`` reports). It reports median and best of ``--iters`` after warm-up,
block positions per second (``batch × block / latency``: multiply by TPF / block for answer
tokens/s) and the weight-read floor of one step: weight bytes / HBM
bandwidth (H100 SXM 3.35 TB/s, H200 4.8 TB/s; from the GPU name, or ``--bandwidth-tbps``).
Needs only torch, safetensors and the project; a deadline (``--max-seconds``, default 240)
keeps it under 5 minutes. Writes ``benchmarks/results/gpu_llada8b.json`` (+ ``.png`` with
matplotlib).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, TypeVar

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    RESULTS_DIR,
    add_threads_option,
    apply_threads,
    at_least,
    finite_float,
    machine_info,
    ms,
    plot_if_available,
    write_json,
)

from dllm_serve.decoding.protocol import AttentionKind, RowSpec
from dllm_serve.engine.model_runner import ModelRunner
from dllm_serve.models.families.llada import LLADA
from dllm_serve.models.kv_pool import PAGE_SIZE, KVPages
from dllm_serve.models.transformer import DecoderTransformer, TransformerConfig

REPO = Path(__file__).resolve().parents[1]
M = TypeVar("M", bound=torch.nn.Module)
DEFAULT_CONFIG = REPO / "tests" / "fixtures" / "llada-8b-instruct" / "config.json"
# HBM bandwidth in bytes/s, algorithms.md §6.1 (SXM parts; PCIe/NVL variants are lower).
BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12}
MODES = ("no_cache", "prefix_refresh", "prefix_cache")


def bandwidth_for(name: str) -> float | None:
    """Bytes/s for a GPU name containing a known part (H200 checked before H100)."""
    return next((bw for part, bw in BANDWIDTH.items() if part in name.upper()), None)


def tiny_config(full: TransformerConfig) -> TransformerConfig:
    """The same architecture at toy size: the CPU smoke path runs in well under a second."""
    return dataclasses.replace(
        full, vocab_size=512, d_model=64, n_heads=4, n_kv_heads=4, head_dim=16,
        n_layers=2, mlp_hidden_size=128, rotary_dim=0,  # 0: the whole (smaller) head
    )  # fmt: skip


def build_model(
    cfg: TransformerConfig, device: torch.device, dtype: torch.dtype
) -> DecoderTransformer:
    """Meta → fused projections → empty ``dtype`` storage on ``device`` → random values.

    Never materialises an fp32 copy (32 GB at 8B) and never touches the disk; the values only
    need to be finite, since timing does not depend on them. The projections are fused on the
    meta device, so the ModelRunner's ``fuse_projections`` has nothing left to do (fusing real
    weights would build each fused ``nn.Linear`` on the CPU first).
    """
    with torch.device("meta"):
        model = DecoderTransformer(cfg).fuse_projections()
    return materialise_random(model, device, dtype)


def materialise_random(module: M, device: torch.device, dtype: torch.dtype) -> M:
    """A module built on the meta device, given empty ``dtype`` storage on ``device`` and
    random values: N(0, 0.02) matrices, 1-D parameters (norm gains, biases) all ones."""
    module = module.to(dtype=dtype).to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for param in module.parameters():
            if param.ndim == 1:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    return module.eval()


def model_for(args: argparse.Namespace, device: torch.device) -> DecoderTransformer:
    """The random-weight model of ``--config`` (toy size with ``--tiny``) on ``device``:
    bf16 on a GPU, fp32 on CPU (where bf16 matmuls are slow emulation)."""
    full = LLADA.transformer_config(json.loads(args.config.read_text()))
    cfg = tiny_config(full) if args.tiny else full
    return build_model(cfg, device, torch.bfloat16 if device.type == "cuda" else torch.float32)


def build_runner(
    model: DecoderTransformer, device: torch.device, args: argparse.Namespace
) -> ModelRunner:
    """One ModelRunner for every batch size: a KV span of prefix + block slots per row of the
    largest batch, as the engine sizes a request's span for its whole canvas. Cached steps
    replay a CUDA graph in ``run`` (on CPU the same static forward, uncaptured) unless
    ``--no-cuda-graph``; ``forward`` on a built batch stays eager."""
    runner = ModelRunner(
        model,
        device,
        kv_slots=max(args.batches) * whole_pages(args.prefix + args.block),
        cuda_graph=not args.no_cuda_graph,
        graph_max_rows=max(args.batches),
    )
    assert runner.pool is not None
    return runner


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_it(
    fn: Any, runner: ModelRunner, device: torch.device, warmup: int, iters: int
) -> tuple[list[float], list[float]]:
    """Wall seconds of ``fn()`` per call, synchronised before and after each call, after
    ``warmup`` untimed calls; and the runner's own duration of each call's forward (CUDA
    events on a GPU: the kernels alone, without the host-side packing)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times, forward = [], []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
        forward.append(runner.forward_seconds())
    return times, forward


def make_rows(
    runner: ModelRunner, batch: int, prefix: int, block: int
) -> tuple[dict[str, list[RowSpec]], list[KVPages]]:
    """Each mode's rows (random tokens, one KV span of prefix + block slots per row)."""
    assert runner.pool is not None
    vocab = runner.model.config.vocab_size
    gen = torch.Generator(device="cpu").manual_seed(batch)
    ids = torch.randint(0, vocab, (batch, prefix + block), generator=gen).tolist()
    spans = []
    for _ in range(batch):
        span = runner.pool.reserve(prefix + block)
        if span is None:
            raise RuntimeError("the KV pool was sized for every row: allocation cannot fail")
        spans.append(span)
    block_at = list(range(prefix, prefix + block))
    bi = AttentionKind.BIDIRECTIONAL
    rows = {
        # Logits only where the block is, as the denoiser asks for its active block.
        "no_cache": [RowSpec(row, 0, block_at, bi) for row in ids],
        "prefix_refresh": [
            RowSpec(row, 0, block_at, bi, kv) for row, kv in zip(ids, spans, strict=True)
        ],
        "prefix_cache": [
            RowSpec(row[prefix:], prefix, list(range(block)), bi, kv)
            for row, kv in zip(ids, spans, strict=True)
        ],
    }
    return rows, spans


def measure(
    runner: ModelRunner,
    batch: int,
    prefix: int,
    block: int,
    device: torch.device,
    warmup: int,
    iters: int,
) -> dict[str, Any]:
    """No-cache, refresh and cached-step latency for one batch size."""
    assert runner.pool is not None
    rows, spans = make_rows(runner, batch, prefix, block)
    out: dict[str, Any] = {"batch": batch}
    try:
        with torch.inference_mode():
            for mode in MODES:
                if mode == "prefix_cache":
                    # The refresh forwards (timed just before) wrote every row's prefix K/V.
                    for span in spans:
                        span.length = prefix
                flat, _width = runner.build(rows[mode])
                fed = len(rows[mode][0].tokens)
                times, kernels = time_it(
                    lambda flat=flat: runner.forward(flat), runner, device, warmup, iters
                )
                graphs = runner.graphs
                replays = graphs.replays if graphs is not None else 0
                run_times, _ = time_it(
                    lambda mode=mode: runner.run(rows[mode]), runner, device, 1, iters
                )
                med = statistics.median(times)
                out[mode] = {
                    "tokens_fed_per_row": fed,
                    "flat_tokens": flat.num_tokens,
                    "latency_ms_median": ms(med),
                    "latency_ms_best": ms(min(times)),
                    "runner_forward_ms_median": ms(statistics.median(kernels)),
                    "run_ms_median": ms(statistics.median(run_times)),
                    # Whether ``run`` replayed a captured graph (cached steps with graphs on):
                    # then run_ms_median is the graph's time, latency_ms_* the eager forward's.
                    "run_replayed_graph": graphs is not None and graphs.replays > replays,
                    "block_positions_per_s": round(batch * block / med, 1),
                    "forwards_per_s": round(1 / med, 2),
                }
                del flat
            # Sanity: with the prefix K/V of this very canvas, the cached step's logits are the
            # refresh's (exact up to kernel rounding), else the timing measured a wrong forward.
            full = runner.run(rows["prefix_refresh"]).as_padded().float()
            cached = runner.run(rows["prefix_cache"]).as_padded().float()
            out["cached_vs_refresh_max_abs_logit_diff"] = round(
                (full - cached).abs().max().item(), 6
            )
        pool = runner.pool
        # The pages the rows hold (their prefixes and blocks), as the engine's gauge counts.
        out["kv_pool_used_bytes"] = pool.pages_used * pool.page_size * (pool.nbytes // pool.slots)
    finally:
        for span in spans:
            runner.pool.free(span)
    return out


def draw(report: dict[str, Any]) -> Any:
    """Median latency per batch size and mode, with the bandwidth floor as a line."""

    def _draw(plt: Any) -> None:
        _fig, ax = plt.subplots(figsize=(6, 4))
        rows = report["results"]
        labels = [str(r["batch"]) for r in rows]
        x = range(len(rows))
        width = 0.8 / len(MODES)
        for i, mode in enumerate(MODES):
            ax.bar(
                [xi + width * i for xi in x],
                [r[mode]["latency_ms_median"] for r in rows],
                width=width,
                label=mode,
            )
        floor = report["bandwidth_floor_ms"]
        if floor:
            ax.axhline(floor, color="k", linestyle="--", label="weight-read floor")
        ax.set_xticks([xi + width * (len(MODES) - 1) / 2 for xi in x], labels)
        ax.set(xlabel="batch", ylabel="ms per forward", title=report["device_name"])
        ax.legend()

    return _draw


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", type=at_least(1), nargs="+", default=[1, 16])
    parser.add_argument("--prefix", type=at_least(0), default=512, help="prompt/prefix tokens")
    parser.add_argument("--block", type=at_least(1), default=32, help="block (canvas) tokens")
    parser.add_argument("--warmup", type=at_least(0), default=3)
    parser.add_argument("--iters", type=at_least(1), default=20)
    parser.add_argument("--bandwidth-tbps", type=finite_float, default=None, help="override (TB/s)")
    parser.add_argument(
        "--max-seconds", type=finite_float, default=240.0, help="stop measuring after"
    )
    parser.add_argument("--allow-cpu", action="store_true", help="with --tiny: CPU smoke run")
    parser.add_argument(
        "--no-cuda-graph", action="store_true", help="run() eagerly for cached steps too"
    )
    parser.add_argument("--tiny", action="store_true", help="toy size, same architecture")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "gpu_llada8b.json")
    add_threads_option(parser)
    args = parser.parse_args(argv)
    apply_threads(args.threads)
    started = time.monotonic()

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        if not (args.allow_cpu and args.tiny):
            print(
                "gpu_llada8b: no CUDA device here. This benchmark is meant for a lent GPU; "
                "an 8B model on CPU would take hours. For a smoke run use --allow-cpu --tiny.",
                file=sys.stderr,
            )
            return None
        device = torch.device("cpu")
    elif device.type == "cpu" and not (args.allow_cpu and args.tiny):
        print("gpu_llada8b: on CPU only with --allow-cpu --tiny.", file=sys.stderr)
        return None

    model = model_for(args, device)
    dtype = model.embed_tokens.weight.dtype
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    params = sum(p.numel() for p in model.parameters())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    bw = args.bandwidth_tbps * 1e12 if args.bandwidth_tbps else bandwidth_for(name)
    floor_s = weight_bytes / bw if bw else None
    print(f"{name}: {params / 1e9:.3f} B params, {weight_bytes / 1e9:.2f} GB weights, floor "
          f"{ms(floor_s)} ms/forward at {bw and bw / 1e12} TB/s")  # fmt: skip
    runner = build_runner(model, device, args)

    results = []
    for batch in args.batches:
        if time.monotonic() - started > args.max_seconds:
            print(f"deadline reached: batch {batch} skipped")
            break
        row = measure(runner, batch, args.prefix, args.block, device, args.warmup, args.iters)
        for mode in MODES:
            m = row[mode]
            # Achieved fraction of the weight-read floor: 1.0 = as fast as HBM allows.
            m["floor_over_latency"] = (
                round(floor_s * 1e3 / m["latency_ms_median"], 3) if floor_s else None
            )
            print(
                f"batch {batch:3d} {mode:14s} {m['latency_ms_median']:9.3f} ms  "
                f"{m['block_positions_per_s']:10.1f} block pos/s  floor/latency "
                f"{m['floor_over_latency']}"
            )
        results.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    report = {
        "benchmark": "gpu_llada8b",
        "config": str(
            args.config.relative_to(REPO) if args.config.is_relative_to(REPO) else args.config
        ),
        "tiny": args.tiny,
        "random_weights": True,
        "device": str(device),
        "device_name": name,
        "dtype": str(dtype).removeprefix("torch."),
        "params": params,
        "weight_bytes": weight_bytes,
        "bandwidth_bytes_per_s": bw,
        "bandwidth_floor_ms": ms(floor_s),
        "bandwidth_floor_forwards_per_s": round(1 / floor_s, 1) if floor_s else None,
        "prefix": args.prefix,
        "block": args.block,
        "warmup": args.warmup,
        "iters": args.iters,
        "cuda_graph": runner.graphs is not None and runner.graphs.capture,
        "kv_pool_slots": runner.pool.slots,
        "kv_pool_bytes": runner.pool.nbytes,
        "results": results,
        "peak_memory_bytes": (
            torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        ),
        "seconds_total": round(time.monotonic() - started, 1),
        "machine": machine_info(),
    }
    write_json(args.out, report)
    plot_if_available(args.out.with_suffix(".png"), draw(report))
    return report


if __name__ == "__main__":
    # A refusal (no GPU) exits 2, so a script chaining benchmarks notices it.
    sys.exit(0 if main() is not None else 2)


def whole_pages(tokens: int) -> int:
    """``tokens`` rounded up to whole KV pages (a request's reservation)."""
    return -(-tokens // PAGE_SIZE) * PAGE_SIZE
