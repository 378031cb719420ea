"""Tensor parallelism's cost per step on CPU: TP=2 against TP=1, side by side in one run.

    python benchmarks/tensor_parallel.py                    # demo-llada, 16 requests
    python benchmarks/tensor_parallel.py --model DIR --requests 32 --repeat 3

The same ``--requests`` chats go through the offline :class:`LLM` (the server's engine) with
one process holding the whole model, then with ``--tensor-parallel-size 2`` (gloo, one torch
thread per rank), alternating ``--repeat`` times so background load hits both alike. Reported:
seconds per engine step (wall time over forward passes), the TP=2/TP=1 ratio per pair and
their median, whether the answers were identical (they must be: TP is exact at T = 0), and
the bytes per step the vocab-parallel sampler brought to rank 0 against what gathering the
logits would (``sampler_bytes_per_step``, ``gather_bytes_per_step``).
On a CPU the collectives (two all-reduces per layer, the sampler's reductions) cost more than
halving each matmul saves for a small model; the point of TP is models that do not fit one
device. Writes ``benchmarks/results/tensor_parallel.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PROMPTS, RESULTS_DIR, at_least, machine_info, write_json

from dllm_serve.decoding.params import DecodingParams
from dllm_serve.engine.workers import launch
from dllm_serve.llm import LLM
from dllm_serve.models.loader import load_model


def timed(llm: LLM, conversations: list, params: DecodingParams) -> tuple[float, int, list[str]]:
    started = time.perf_counter()
    outs = llm.generate(conversations, params)
    seconds = time.perf_counter() - started
    return seconds, max(o.nfe for o in outs), [o.text for o in outs]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="demo-llada")
    p.add_argument("--requests", type=at_least(1), default=16)
    p.add_argument("--gen-length", type=at_least(1), default=32)
    p.add_argument("--repeat", type=at_least(1), default=3)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "tensor_parallel.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    conversations = [
        [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}] for i in range(args.requests)
    ]
    params = DecodingParams(gen_length=args.gen_length, steps=args.gen_length)
    one = LLM.from_loaded(load_model(args.model, device="cpu", dtype="float32"))
    sharded = launch(args.model, "cpu", "float32", 2, threads=1)
    traffic, vocab = sharded.parallel.traffic, sharded.model.config.vocab_size * 2
    two = LLM.from_loaded(sharded)
    pairs, same, steps2_total = [], True, 0
    try:
        for llm in (one, two):  # warm-up
            timed(llm, conversations, params)
        before = dataclasses.replace(traffic)
        for _ in range(args.repeat):
            s1, steps1, text1 = timed(one, conversations, params)
            s2, steps2, text2 = timed(two, conversations, params)
            same &= text1 == text2 and steps1 == steps2
            steps2_total += steps2
            pairs.append({"tp1_step_ms": 1000 * s1 / steps1, "tp2_step_ms": 1000 * s2 / steps2})
    finally:
        one.close()
        two.close()
    ratios = [q["tp2_step_ms"] / q["tp1_step_ms"] for q in pairs]
    # What the vocab-parallel sampler brought to rank 0 per step, against gathering the other
    # rank's half of every reduced position's logits (fp32), as a gathering sampler would.
    positions = traffic.reduced_positions - before.reduced_positions
    received = traffic.bytes - before.bytes
    report = {
        "model": args.model,
        "requests": args.requests,
        "gen_length": args.gen_length,
        "pairs": [{k: round(v, 3) for k, v in q.items()} for q in pairs],
        "tp2_over_tp1_step_time": round(statistics.median(ratios), 3),
        "ratio_min_max": [round(min(ratios), 3), round(max(ratios), 3)],
        "identical_answers": same,
        "sampler_bytes_per_step": round(received / steps2_total),
        "gather_bytes_per_step": round(positions * (vocab // 2) * 4 / steps2_total),
        "machine": machine_info(),
        "command": " ".join(sys.argv),
    }
    print(report)
    write_json(args.out, report)


if __name__ == "__main__":
    main()
