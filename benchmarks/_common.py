"""Helpers shared by the benchmark scripts: result paths, JSON/PNG output, percentiles.

Kept dependency-free on purpose: matplotlib is an optional extra (``pip install -e .[bench]``),
so every plot goes through :func:`plot_if_available`, which silently skips when it is absent.
The JSON is always written; it is the result, the PNG only a picture of it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from dllm_serve.arg_types import at_least, finite_float

# The scripts' count and seconds arguments (re-exported for them).
__all__ = ["at_least", "finite_float"]

RESULTS_DIR = Path(__file__).resolve().parent / "results"


# The prompts every benchmark sends (short chat questions, as a user would ask).
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers.",
    "Translate 'good morning' into German.",
    "Why is the sky blue?",
    "Give me a name for a cat.",
    "What is 12 times 7?",
]


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (``q`` in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(rank), math.ceil(rank)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def ms(seconds: float | None) -> float | None:
    """Seconds → milliseconds rounded for reports (None stays None)."""
    return None if seconds is None else round(seconds * 1e3, 3)


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on: they mean nothing without it."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def add_threads_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--threads", type=at_least(0), default=0, help="torch CPU threads (0: torch's default)"
    )


def apply_threads(threads: int) -> None:
    """On a shared machine more threads than free cores make every op spin-wait."""
    if threads:
        torch.set_num_threads(threads)


def gpu_device(args: argparse.Namespace, script: str) -> torch.device | None:
    """``--device`` of a GPU benchmark; without CUDA the CPU for an ``--allow-cpu --tiny``
    smoke run, else None after a one-line refusal (the script then exits 2)."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        if not (args.allow_cpu and args.tiny):
            print(f"{script}: no CUDA device (use --allow-cpu --tiny).", file=sys.stderr)
            return None
        device = torch.device("cpu")
    return device


def gpu_report_head(benchmark: str, tiny: bool, device: torch.device) -> dict[str, Any]:
    """The first keys of a GPU benchmark's report: what ran, at which size, on which device."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"benchmark": benchmark, "tiny": tiny, "device": str(device), "device_name": name}


def write_json(path: Path, report: dict[str, Any]) -> Path:
    """Write ``report`` as indented JSON, creating the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
    return path


def plot_if_available(path: Path, draw: Callable[[Any], None]) -> Path | None:
    """Call ``draw(pyplot)`` and save to ``path`` when matplotlib is importable, else skip.

    The Agg backend is forced so that a headless server (no display) can still plot.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG (pip install -e '.[bench]')")
        return None
    draw(plt)
    path.parent.mkdir(parents=True, exist_ok=True)
    plt.tight_layout()
    plt.savefig(path, dpi=110)
    plt.close("all")
    print(f"wrote {path}")
    return path


def add_demo_options(parser: argparse.ArgumentParser, families: Sequence[str]) -> None:
    """``--only FAMILY``, ``--model-path`` and ``--out`` of the scripts that measure the demos."""
    parser.add_argument("--only", choices=list(families))
    parser.add_argument(
        "--model-path",
        type=Path,
        help="measure this checkpoint (e.g. a training run's output) instead of the shipped "
        "demo; needs --only and --out",
    )
    parser.add_argument("--out", type=Path, help="results file (default: benchmarks/results/...)")


def demo_families(
    parser: argparse.ArgumentParser, args: argparse.Namespace, families: Sequence[str]
) -> list[str]:
    """The families to measure; one results file (``--out``) holds one family's results."""
    if args.out and not args.only:
        choices = ", ".join(families[:-1]) + " or " + families[-1]
        parser.error(f"--out names one results file: add --only {choices}")
    if args.model_path and not (args.only and args.out):
        parser.error("--model-path needs --only (which family) and --out")
    return [args.only] if args.only else list(families)
