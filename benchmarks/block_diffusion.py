"""Block diffusion (SDAR, LLaDA2, Fast-dLLM v2 formats): forwards and tokens per forward.

    python benchmarks/block_diffusion.py --threads 1    # tiny random SDAR, LLaDA2, Fast-dLLM v2
    python benchmarks/block_diffusion.py --model /models/SDAR-4B-Chat --device cuda

For each model and setting (top-k with B steps per block or fewer, threshold decoding; for
SDAR-style models also the finished block's write fused with the next block's first step or
not — Fast-dLLM v2's write gives the next block's first token and is never fused), every
prompt of the shared list is answered alone through the offline ``LLM`` API at temperature 0,
and the report gives NFE (forwards, the prefill and writes included), answer tokens, NFE per
answer token and canvas tokens committed per forward. Without ``--model`` three tiny
random-weight checkpoints are written first (``make-tiny --family sdar``, block 4,
``--family llada2``, block 32, mixture of experts, and ``--family fastdllm``, block 32 in
sub-blocks of 8): their answers are gibberish but the forward
counts follow the decoding rules exactly. Writes ``benchmarks/results/block_diffusion.json``.
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
    at_least,
    machine_info,
    write_json,
)

from dllm_serve.decoding.fast_dllm import FastDLLMDecoder
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.llm import LLM
from dllm_serve_train.tiny_checkpoints import (
    write_tiny_fastdllm,
    write_tiny_llada2,
    write_tiny_sdar,
)


def settings(block: int) -> dict[str, dict[str, Any]]:
    return {
        f"top-k, {block} steps/block": {"steps": block},
        f"top-k, {max(1, block // 2)} steps/block": {"steps": max(1, block // 2)},
        "threshold 0.9": {"steps": block, "confidence_threshold": 0.9},
        "threshold 0.5": {"steps": block, "confidence_threshold": 0.5},
    }


def measure(model: str, device: str, max_tokens: int, conversations: list) -> dict[str, Any]:
    """Every setting's counts for one checkpoint."""
    rows = []
    with LLM(model, device=device) as llm:
        block = llm.loaded.block_size
        if block is None:
            raise SystemExit(f"{model} is not a block-diffusion checkpoint")
        algorithm = llm.engine.algorithm
        fusable = not isinstance(algorithm, FastDLLMDecoder)
        for fuse in (True, False) if fusable else (False,):
            algorithm.fuse_write = fuse  # type: ignore[union-attr]
            for name, setting in settings(block).items():
                params = DecodingParams(gen_length=max_tokens, **setting)
                outs = [llm.generate([c], params)[0] for c in conversations]
                nfe = sum(o.nfe for o in outs)
                answer = sum(o.completion_tokens for o in outs)
                committed = sum(o.committed for o in outs)
                rows.append({
                    "setting": name, "fused_write": fuse, "nfe": nfe, "answer_tokens": answer,
                    "nfe_per_answer_token": round(nfe / max(answer, 1), 3),
                    "committed_per_forward": round(committed / max(nfe, 1), 3),
                })  # fmt: skip
                per_token = rows[-1]["nfe_per_answer_token"]
                print(f"{llm.loaded.name:14s} {name:24s} fused={fuse!s:5s} NFE {nfe:5d}  "
                      f"answer tokens {answer:5d}  NFE/token {per_token}")  # fmt: skip
        return {
            "model": llm.loaded.name,
            "family": llm.loaded.family.name,
            "block_size": block,
            "sub_block": algorithm.sub_block if not fusable else None,  # type: ignore[union-attr]
            "rows": rows,
        }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="a block-diffusion checkpoint (default: the tiny ones)"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-tokens", type=at_least(1), default=32)
    parser.add_argument("--prompts", type=at_least(1), default=len(PROMPTS))
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "block_diffusion.json")
    add_threads_option(parser)
    args = parser.parse_args(argv)
    apply_threads(args.threads)
    if args.model:
        models = [args.model]
    else:
        tmp = Path(tempfile.mkdtemp())
        models = [
            str(write_tiny_sdar(tmp / "tiny-sdar")),
            str(write_tiny_llada2(tmp / "tiny-llada2")),
            str(write_tiny_fastdllm(tmp / "tiny-fastdllm")),
        ]
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS[: args.prompts]]
    report = {
        "benchmark": "block_diffusion",
        "random_weights": args.model is None,
        "max_tokens": args.max_tokens,
        "prompts": len(conversations),
        "models": [measure(m, args.device, args.max_tokens, conversations) for m in models],
        "machine": machine_info(),
    }
    write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
