"""LLaDA-8B-sized forward latency on a GPU vs the memory-bandwidth bound of its weights.

    python benchmarks/gpu_llada8b.py                          # on a machine with CUDA
    python benchmarks/gpu_llada8b.py --batches 1 16 --prefix 512 --block 32 --iters 20
    python benchmarks/gpu_llada8b.py --allow-cpu --tiny       # smoke path (the unit test)

A random-weight ``DecoderTransformer`` with the shape of LLaDA-8B-Instruct (the config in
``tests/fixtures/llada-8b-instruct/config.json`` through the llada family's
``transformer_config``) is built on the meta device, materialised directly in bf16 on the GPU
and filled with random values: no checkpoint is read or written. For each batch size it times:

- ``no_cache``: one bidirectional forward over prefix + block (what a step costs without a KV
  cache: the whole sequence is recomputed), LM head at the block's positions;
- ``prefix_cache``: one forward over the block only, reading the prefix's cached keys/values
  (Fast-dLLM prefix cache; the cache is filled once beforehand and never written during timing).

and reports latency (median and best of ``--iters`` after warm-up), block positions per second
(``batch × block / latency``: multiply by TPF / block for answer tokens/s) and the floor from
``../shared/reference/algorithms.md`` §6: weight bytes / HBM bandwidth (H100 SXM 3.35 TB/s,
H200 4.8 TB/s; from the GPU name, or ``--bandwidth-tbps``). Needs only torch, safetensors and the
project; a deadline (``--max-seconds``, default 240) keeps it under 5 minutes. Writes
``benchmarks/results/gpu_llada8b.json`` (+ ``.png`` with matplotlib).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    RESULTS_DIR,
    add_threads_option,
    apply_threads,
    machine_info,
    ms,
    plot_if_available,
    write_json,
)

from dllm_serve.models.families.llada import LLADA
from dllm_serve.models.kv_cache import KVBatch, KVCache
from dllm_serve.models.transformer import DecoderTransformer, TransformerConfig

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "tests" / "fixtures" / "llada-8b-instruct" / "config.json"
# HBM bandwidth in bytes/s, algorithms.md §6.1 (SXM parts; PCIe/NVL variants are lower).
BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12}


def bandwidth_for(name: str) -> float | None:
    """Bytes/s for a GPU name containing a known part (H200 checked before H100)."""
    return next((bw for part, bw in BANDWIDTH.items() if part in name.upper()), None)


def tiny_config(full: TransformerConfig) -> TransformerConfig:
    """The same architecture at toy size: the CPU smoke path runs in well under a second."""
    return dataclasses.replace(
        full, vocab_size=512, d_model=64, n_heads=4, n_kv_heads=4, head_dim=16,
        n_layers=2, mlp_hidden_size=128,
    )  # fmt: skip


def build_model(
    cfg: TransformerConfig, device: torch.device, dtype: torch.dtype
) -> DecoderTransformer:
    """Meta → empty ``dtype`` storage on ``device`` → random values, in place.

    Never materialises an fp32 copy (32 GB at 8B) and never touches the disk; the values only
    need to be finite, since timing does not depend on them.
    """
    with torch.device("meta"):
        model = DecoderTransformer(cfg)
    model = model.to(dtype=dtype).to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:  # RMSNorm gains
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    return model.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_it(fn: Any, device: torch.device, warmup: int, iters: int) -> list[float]:
    """Wall seconds of ``fn()`` per call, synchronised, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def measure(
    model: DecoderTransformer,
    batch: int,
    prefix: int,
    block: int,
    device: torch.device,
    warmup: int,
    iters: int,
) -> dict[str, Any]:
    """No-cache and prefix-cache forward latency for one batch size."""
    vocab = model.config.vocab_size
    gen = torch.Generator(device="cpu").manual_seed(batch)
    full_ids = torch.randint(0, vocab, (batch, prefix + block), generator=gen).to(device)
    full_pos = torch.arange(prefix + block, device=device).expand(batch, -1)
    block_ids = full_ids[:, prefix:]

    def no_cache() -> None:
        hidden = model(full_ids, full_pos, None)  # bidirectional over all positions
        model.lm_head(hidden[:, prefix:])  # logits only where the block is

    caches = [KVCache.for_model(model, capacity=prefix) for _ in range(batch)]
    with torch.inference_mode():
        # Fill each row's cache with the prefix once (write=prefix), as a block refresh would.
        model(full_ids[:, :prefix], full_pos[:, :prefix], None, kv_cache=KVBatch(caches, prefix))

    def prefix_cache() -> None:
        kv = KVBatch(caches, write=0)  # read only: every call is the same forward
        hidden = model(block_ids, kv.positions(block, device), None, kv_cache=kv)
        model.lm_head(hidden)

    out: dict[str, Any] = {"batch": batch}
    with torch.inference_mode():
        for name, fn, fed in (
            ("no_cache", no_cache, prefix + block),
            ("prefix_cache", prefix_cache, block),
        ):
            times = time_it(fn, device, warmup, iters)
            med = statistics.median(times)
            out[name] = {
                "tokens_fed_per_row": fed,
                "latency_ms_median": ms(med),
                "latency_ms_best": ms(min(times)),
                "block_positions_per_s": round(batch * block / med, 1),
                "forwards_per_s": round(1 / med, 2),
            }
    out["kv_cache_bytes"] = sum(c.nbytes for c in caches)
    return out


def draw(report: dict[str, Any]) -> Any:
    """Median latency per batch size and mode, with the bandwidth floor as a line."""

    def _draw(plt: Any) -> None:
        _fig, ax = plt.subplots(figsize=(6, 4))
        rows = report["results"]
        labels = [str(r["batch"]) for r in rows]
        x = range(len(rows))
        for i, mode in enumerate(("no_cache", "prefix_cache")):
            ax.bar(
                [xi + 0.4 * i for xi in x],
                [r[mode]["latency_ms_median"] for r in rows],
                width=0.4,
                label=mode,
            )
        floor = report["bandwidth_floor_ms"]
        if floor:
            ax.axhline(floor, color="k", linestyle="--", label="weight-read floor")
        ax.set_xticks([xi + 0.2 for xi in x], labels)
        ax.set(xlabel="batch", ylabel="ms per forward", title=report["device_name"])
        ax.legend()

    return _draw


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prefix", type=int, default=512, help="prompt/prefix tokens")
    parser.add_argument("--block", type=int, default=32, help="block (canvas) tokens")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--bandwidth-tbps", type=float, default=None, help="override (TB/s)")
    parser.add_argument("--max-seconds", type=float, default=240.0, help="stop measuring after")
    parser.add_argument("--allow-cpu", action="store_true", help="with --tiny: CPU smoke run")
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

    full = LLADA.transformer_config(json.loads(args.config.read_text()))
    cfg = tiny_config(full) if args.tiny else full
    # bf16 everywhere on GPU; fp32 on CPU, where bf16 matmuls are slow emulation.
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(cfg, device, dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    params = sum(p.numel() for p in model.parameters())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    bw = args.bandwidth_tbps * 1e12 if args.bandwidth_tbps else bandwidth_for(name)
    floor_s = weight_bytes / bw if bw else None
    print(f"{name}: {params / 1e9:.3f} B params, {weight_bytes / 1e9:.2f} GB weights, floor "
          f"{ms(floor_s)} ms/forward at {bw and bw / 1e12} TB/s")  # fmt: skip

    results = []
    for batch in args.batches:
        if time.monotonic() - started > args.max_seconds:
            print(f"deadline reached: batch {batch} skipped")
            break
        row = measure(model, batch, args.prefix, args.block, device, args.warmup, args.iters)
        for mode in ("no_cache", "prefix_cache"):
            m = row[mode]
            # Achieved fraction of the weight-read floor: 1.0 = as fast as HBM allows.
            m["floor_over_latency"] = (
                round(floor_s * 1e3 / m["latency_ms_median"], 3) if floor_s else None
            )
            print(
                f"batch {batch:3d} {mode:12s} {m['latency_ms_median']:9.3f} ms  "
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
