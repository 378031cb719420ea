"""One MoE layer of LLaDA2.0-mini's shape: grouped expert GEMMs against experts one by one.

    python benchmarks/gpu_moe_layer.py                          # on a machine with CUDA (bf16)
    python benchmarks/gpu_moe_layer.py --allow-cpu --tiny       # smoke path (the unit test)

A :class:`MoE` layer with the routing and sizes of ``tests/fixtures/llada2-mini/config.json``
(256 experts, top-8 in 4 of 8 groups, width 512, a shared expert; random weights, no
checkpoint) is fused as the serving runtime fuses it (experts stacked), then timed for each
token count in ``--tokens`` two ways: the grouped path (two ``torch._grouped_mm`` calls, nothing
read back to the host) and the fallback that runs the experts one by one and reads their
token counts on the host. It reports the median milliseconds of each, their ratio, and the
relative difference of the outputs (bf16 rounding; 0 on CPU, where they are bitwise equal).
If the grouped op refuses the inputs it says so and reports the fallback only. Writes
``benchmarks/results/gpu_moe_layer.json``.
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
    at_least,
    gpu_device,
    gpu_report_head,
    machine_info,
    write_json,
)
from gpu_llada8b import materialise_random, sync

from dllm_serve.models.families.llada2 import LLADA2
from dllm_serve.models.moe import MoE

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "tests" / "fixtures" / "llada2-mini" / "config.json"


def build_layer(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> MoE:
    """The config's MoE layer (toy size with ``--tiny``), random weights, fused."""
    full = LLADA2.transformer_config(json.loads(args.config.read_text()))
    assert full.moe is not None, "the config has no MoE layers"
    cfg, d_model = full.moe, full.d_model
    if args.tiny:
        cfg = dataclasses.replace(cfg, num_experts=16, n_group=4, topk_group=2, top_k=4,
                                  expert_hidden_size=32, shared_hidden_size=32)  # fmt: skip
        d_model = 64
    with torch.device("meta"):
        layer = MoE(d_model, cfg)
    layer = materialise_random(layer, device, dtype)
    layer.router.float()  # routing runs in fp32, as the loader keeps the router
    layer.fuse()  # on the device and in the dtype it runs in: fuse() checks the grouped op
    return layer


def median_ms(fn: Any, device: torch.device, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 4)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=at_least(1), nargs="+", default=[32, 512, 4096])
    parser.add_argument("--warmup", type=at_least(0), default=3)
    parser.add_argument("--iters", type=at_least(1), default=20)
    parser.add_argument("--allow-cpu", action="store_true", help="with --tiny: CPU smoke run")
    parser.add_argument("--tiny", action="store_true", help="toy size, same routing rule")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "gpu_moe_layer.json")
    add_threads_option(parser)
    args = parser.parse_args(argv)
    apply_threads(args.threads)

    device = gpu_device(args, "gpu_moe_layer")
    if device is None:
        return None
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    layer = build_layer(args, device, dtype)
    results = []
    for tokens in args.tokens:
        x = torch.randn(tokens, layer.router.weight.shape[1], device=device, dtype=dtype)
        with torch.no_grad():
            layer.grouped_refused = False
            grouped_out = layer(x)
            refused = layer.grouped_refused
            grouped = (
                None
                if refused
                else median_ms(lambda x=x: layer(x), device, args.warmup, args.iters)
            )
            layer.grouped_refused = True
            fallback_out = layer(x)
            one_by_one = median_ms(lambda x=x: layer(x), device, args.warmup, args.iters)
        diff = (grouped_out.float() - fallback_out.float()).norm() / fallback_out.float().norm()
        row = {
            "tokens": tokens,
            "grouped_ms": grouped,
            "one_by_one_ms": one_by_one,
            "one_by_one_over_grouped": round(one_by_one / grouped, 3) if grouped else None,
            "grouped_refused": refused,
            "relative_difference": float(diff),
        }
        print(
            f"{tokens:6d} tokens: grouped {grouped} ms, one by one {one_by_one} ms "
            f"(ratio {row['one_by_one_over_grouped']}), rel. diff {row['relative_difference']:.2e}"
            + (" — torch._grouped_mm refused these inputs" if refused else "")
        )
        results.append(row)
    report = {
        **gpu_report_head("gpu_moe_layer", args.tiny, device),
        "dtype": str(dtype).removeprefix("torch."),
        "experts": layer.cfg.num_experts,
        "top_k": layer.cfg.top_k,
        "expert_hidden_size": layer.cfg.expert_hidden_size,
        "results": results,
        "machine": machine_info(),
    }
    write_json(args.out, report)
    return report


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 2)
