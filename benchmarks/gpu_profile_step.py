"""Where one LLaDA-8B-shaped step spends its device time: kernels per call and the top kernels.

    python benchmarks/gpu_profile_step.py                       # on a machine with CUDA
    python benchmarks/gpu_profile_step.py --allow-cpu --tiny    # smoke path (the unit test)

Companion to ``gpu_llada8b.py`` (same random-weight model, rows and KV pool, built by its
helpers). For each batch size it profiles, with ``torch.profiler``, a few calls of:

- ``eager``: ``ModelRunner.forward`` on a prebuilt flat batch of cached block-step rows (the
  prefix K/V read from the pool; what ``latency_ms_*`` of ``prefix_cache`` times);
- ``run``: ``ModelRunner.run`` on the same rows (a CUDA graph replay where graphs are on, else
  the eager forward plus host packing).

It reports device kernels per call (launch-bound when that times ~5 µs nears the latency), the
summed kernel time per call, and the ``--top`` kernels by total device time, so the gap to the
weight-read floor can be placed: GEMMs near the floor mean the rest is launches and glue.
Writes ``benchmarks/results/gpu_profile_step.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS_DIR, at_least, gpu_device, gpu_report_head, write_json
from gpu_llada8b import DEFAULT_CONFIG, build_runner, make_rows, model_for, sync


def kernel_events(prof: Any, cuda: bool) -> list[Any]:
    """The profiler's per-name averages of device kernels (CPU ops when there is no GPU)."""
    events = prof.key_averages()
    if not cuda:
        return [e for e in events if e.cpu_time_total > 0]
    kernels = [e for e in events if getattr(e, "device_type", None) == DeviceType.CUDA]
    # Older profilers leave device_type unset on kernel rows: then whatever has own device time.
    return kernels or [e for e in events if device_us(e, cuda) > 0 and e.cpu_time_total == 0]


def device_us(event: Any, cuda: bool) -> float:
    if not cuda:
        return float(event.self_cpu_time_total)
    return float(getattr(event, "self_device_time_total", 0.0) or event.self_cuda_time_total)


def profile_calls(fn: Any, calls: int, device: torch.device, top: int) -> dict[str, Any]:
    """Kernels and device time per call of ``fn`` over ``calls`` profiled calls (after one)."""
    cuda = device.type == "cuda"
    fn()
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        sync(device)
    events = kernel_events(prof, cuda)
    launches = sum(e.count for e in events)
    total_us = sum(device_us(e, cuda) for e in events)
    ranked = sorted(events, key=lambda e: device_us(e, cuda), reverse=True)[:top]
    return {
        "kernels_per_call": round(launches / calls, 1),
        "kernel_ms_per_call": round(total_us / calls / 1e3, 3),
        "top": [
            {
                "name": e.key[:120],
                "calls_per_step": round(e.count / calls, 1),
                "ms_per_step": round(device_us(e, cuda) / calls / 1e3, 4),
                "share": round(device_us(e, cuda) / total_us, 3) if total_us else None,
            }
            for e in ranked
        ],
    }


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", type=at_least(1), nargs="+", default=[1, 16])
    parser.add_argument("--prefix", type=at_least(0), default=512)
    parser.add_argument("--block", type=at_least(1), default=32)
    parser.add_argument("--calls", type=at_least(1), default=5, help="profiled calls per case")
    parser.add_argument("--top", type=at_least(1), default=15)
    parser.add_argument("--no-cuda-graph", action="store_true")
    parser.add_argument("--allow-cpu", action="store_true", help="with --tiny: CPU smoke run")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "gpu_profile_step.json")
    args = parser.parse_args(argv)

    device = gpu_device(args, "gpu_profile_step")
    if device is None:
        return None
    runner = build_runner(model_for(args, device), device, args)
    results = []
    for batch in args.batches:
        rows, spans = make_rows(runner, batch, args.prefix, args.block)
        try:
            with torch.inference_mode():
                runner.run(rows["prefix_refresh"])  # writes every row's prefix K/V
                for span in spans:
                    span.length = args.prefix
                cached = rows["prefix_cache"]
                flat, _width = runner.build(cached)
                row: dict[str, Any] = {"batch": batch}
                row["eager"] = profile_calls(
                    lambda flat=flat: runner.forward(flat), args.calls, device, args.top
                )
                row["run"] = profile_calls(
                    lambda cached=cached: runner.run(cached), args.calls, device, args.top
                )
                del flat
        finally:
            for span in spans:
                runner.pool.free(span)
        for case in ("eager", "run"):
            c = row[case]
            print(
                f"batch {batch:3d} {case:5s}: {c['kernels_per_call']:7.1f} kernels/call, "
                f"{c['kernel_ms_per_call']:8.3f} ms kernel time/call; top: "
                + "; ".join(f"{t['name'][:40]} {t['ms_per_step']} ms" for t in c["top"][:4])
            )
        results.append(row)
    report = {
        **gpu_report_head("gpu_profile_step", args.tiny, device),
        "prefix": args.prefix,
        "block": args.block,
        "calls": args.calls,
        "cuda_graph": runner.graphs is not None and runner.graphs.capture,
        "results": results,
    }
    write_json(args.out, report)
    return report


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 2)
