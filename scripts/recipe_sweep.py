"""Run several demo-model training recipes side by side (on a lent GPU) and collect results.

    python scripts/recipe_sweep.py --out DIR --device cuda --deadline 420

Each recipe is one ``python -m dllm_serve_train`` process (one CPU thread each, for batch
building); a run still going at the deadline is stopped, and its log keeps the held-out
addition accuracy printed every ``--eval-every`` steps. Writes ``DIR/sweep.json``. The sweep
only chooses the recipe: the committed demo weights come from the training command in each
model card.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from dllm_serve.arg_types import finite_float

COMMON = ["--batch-size", "64", "--addition-weight", "8", "--eval-every", "500", "--threads", "1"]
GPU_LONG = ["--batch-size", "128", "--workers", "4", "--eval-every", "2000"]


def recipe(family: str, d_model: int, layers: int, mlp: int, lr: str, steps: int) -> list[str]:
    return [family, "--d-model", str(d_model), "--n-layers", str(layers), "--mlp", str(mlp),
            "--lr", lr, "--steps", str(steps)]  # fmt: skip


# name: (family, extra arguments). Step counts are what one CPU thread trains in ~80 minutes
# for that size (measured on the 2-core dev machine), so the cosine schedule matches a CPU run.
RECIPES: dict[str, list[str]] = {
    "llada-d128x6-lr2e-3": recipe("llada", 128, 6, 512, "2e-3", 3600),
    "llada-d128x6-lr1e-3": recipe("llada", 128, 6, 512, "1e-3", 3600),
    "llada-d192x6-lr1e-3": recipe("llada", 192, 6, 768, "1e-3", 2200),
    "llada-d192x6-lr2e-3": recipe("llada", 192, 6, 768, "2e-3", 2200),
    "llada-d256x4-lr1e-3": recipe("llada", 256, 4, 1024, "1e-3", 2400),
    "llada-d128x4-lr2e-3": recipe("llada", 128, 4, 512, "2e-3", 5000),
    "llada-d128x6-lr2e-3-b32": [*recipe("llada", 128, 6, 512, "2e-3", 7000), "--batch-size", "32"],
    "llada-d192x6-lr1e-3-long": recipe("llada", 192, 6, 768, "1e-3", 8000),
    "idlm-d128x4-lr1e-3": recipe("idlm", 128, 4, 384, "1e-3", 7000),
    "idlm-d128x4-lr2e-3": recipe("idlm", 128, 4, 384, "2e-3", 7000),
    "idlm-d192x4-lr1e-3": recipe("idlm", 192, 4, 576, "1e-3", 5000),
    "idlm-d128x6-lr1e-3": recipe("idlm", 128, 6, 384, "1e-3", 6000),
    # Longer LLaDA runs for a GPU (batches built by DataLoader workers).
    "gpu-llada-d192x6": [*recipe("llada", 192, 6, 768, "1e-3", 8000), *GPU_LONG],
    "gpu-llada-d256x6": [*recipe("llada", 256, 6, 1024, "7e-4", 6000), *GPU_LONG],
    "gpu-llada-d128x6": [*recipe("llada", 128, 6, 512, "1e-3", 10000), *GPU_LONG],
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--deadline", type=finite_float, default=420.0, help="seconds for the whole sweep"
    )
    p.add_argument("--only", nargs="*", help="recipe names (default: all)")
    args = p.parse_args()
    unknown = sorted(set(args.only or ()) - set(RECIPES))
    if unknown:
        p.error(f"--only: unknown recipe(s) {', '.join(unknown)} (recipes: {', '.join(RECIPES)})")
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    procs = {}
    for name, (family, *extra) in RECIPES.items():
        if (args.only and name not in args.only) or (not args.only and name.startswith("gpu-")):
            continue
        cmd = [
            sys.executable,
            "-m",
            "dllm_serve_train",
            "--family",
            family,
            "--out",
            str(args.out / name),
            "--device",
            args.device,
            *COMMON,
            *extra,
        ]
        log = (args.out / f"{name}.log").open("w")
        procs[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), cmd)
    end = time.monotonic() + args.deadline
    while time.monotonic() < end and any(pr.poll() is None for pr, _ in procs.values()):
        time.sleep(2)
    results = {}
    for name, (pr, cmd) in procs.items():
        finished = pr.poll() is not None
        if not finished:
            pr.kill()
        text = (args.out / f"{name}.log").read_text()
        report_path = args.out / name / "training_report.json"
        results[name] = {
            "command": " ".join(cmd[1:]),
            "finished": finished and report_path.exists(),
            "evals": [
                (int(s), float(a))
                for s, a in re.findall(r"step (\d+) held-out addition ([\d.]+)", text)
            ],
            "last_loss_line": ([ln for ln in text.splitlines() if ln.startswith("step ")] or [""])[
                -1
            ],
            "report": json.loads(report_path.read_text()) if report_path.exists() else None,
            "tail": text[-600:],
        }
    (args.out / "sweep.json").write_text(json.dumps(results, indent=2) + "\n")
    for name, r in results.items():
        print(
            name,
            r["finished"],
            r["evals"][-3:],
            r["report"] and r["report"].get("held_out_exact_match"),
        )


if __name__ == "__main__":
    main()
