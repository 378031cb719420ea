"""Block diffusion (SDAR format): forward passes and tokens per forward per decoding setting.

    python benchmarks/block_diffusion.py --threads 1                  # tiny random SDAR, CPU
    python benchmarks/block_diffusion.py --model /models/SDAR-4B-Chat --device cuda

For each setting (top-k with B steps per block or fewer, threshold decoding; the finished
block's write fused with the next block's first step or not), every prompt of the shared list
is answered alone through the offline ``LLM`` API at temperature 0, and the report gives NFE
(forwards, the prefill and writes included), answer tokens, NFE per answer token and canvas
tokens committed per forward. Without ``--model`` a tiny random-weight SDAR checkpoint is
written first (``make-tiny --family sdar``): its answers are gibberish but the forward counts
follow the decoding rules exactly. Writes ``benchmarks/results/block_diffusion.json``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    PROMPTS,
    RESULTS_DIR,
    add_threads_option,
    apply_threads,
    machine_info,
    write_json,
)

from dllm_serve.decoding.params import DecodingParams
from dllm_serve.llm import LLM
from dllm_serve.models.tiny import write_tiny_sdar


def settings(block: int) -> dict[str, dict[str, Any]]:
    return {
        f"top-k, {block} steps/block": {"steps": block},
        f"top-k, {max(1, block // 2)} steps/block": {"steps": max(1, block // 2)},
        "threshold 0.9": {"steps": block, "confidence_threshold": 0.9},
        "threshold 0.5": {"steps": block, "confidence_threshold": 0.5},
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="an SDAR checkpoint (default: tiny)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "block_diffusion.json")
    add_threads_option(parser)
    args = parser.parse_args(argv)
    apply_threads(args.threads)
    model = args.model or str(write_tiny_sdar(Path(tempfile.mkdtemp()) / "tiny-sdar"))
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS[: args.prompts]]
    rows = []
    with LLM(model, device=args.device) as llm:
        block = llm.loaded.block_size
        if block is None:
            raise SystemExit(f"{model} is not a block-diffusion checkpoint")
        for fuse in (True, False):
            llm.engine.algorithm.fuse_write = fuse  # type: ignore[union-attr]
            for name, setting in settings(block).items():
                params = DecodingParams(gen_length=args.max_tokens, **setting)
                outs = [llm.generate([c], params)[0] for c in conversations]
                nfe = sum(o.nfe for o in outs)
                answer = sum(o.completion_tokens for o in outs)
                committed = sum(o.committed for o in outs)
                rows.append({
                    "setting": name, "fused_write": fuse, "nfe": nfe, "answer_tokens": answer,
                    "nfe_per_answer_token": round(nfe / max(answer, 1), 3),
                    "committed_per_forward": round(committed / max(nfe, 1), 3),
                })  # fmt: skip
                print(f"{name:24s} fused={fuse!s:5s} NFE {nfe:5d}  answer tokens {answer:5d}  "
                      f"NFE/token {rows[-1]['nfe_per_answer_token']}")  # fmt: skip
        report = {
            "benchmark": "block_diffusion",
            "model": llm.loaded.name,
            "random_weights": args.model is None,
            "block_size": block,
            "max_tokens": args.max_tokens,
            "prompts": len(conversations),
            "rows": rows,
            "machine": machine_info(),
        }
    write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
