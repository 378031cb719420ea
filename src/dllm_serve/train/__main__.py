"""Train a demo model: ``python -m dllm_serve.train --family {llada,idlm} --out DIR``.

Writes a tiny checkpoint skeleton in the family's real format (config, tokenizer, template),
trains its weights on the task mix from a fixed seed for a fixed number of steps (so the run
is reproducible), saves them under the family's tensor names, and evaluates held-out
exact-match accuracy at default request settings (temperature 0) through the serving engine.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch

from dllm_serve.decoding.params import DecodingParams
from dllm_serve.llm import LLM
from dllm_serve.models.loader import load_model
from dllm_serve.models.tiny import write_tiny
from dllm_serve.models.tiny.files import save_weights
from dllm_serve.train.objectives import idlm_batch, llada_batch, loss
from dllm_serve.train.tasks import TASKS, examples, held_out_set

SIZES = {
    "llada": {"d_model": 192, "n_layers": 6, "n_heads": 6, "mlp_hidden_size": 512},
    "idlm": {"d_model": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "mlp_hidden_size": 384},
}


def train(family: str, out: Path, steps: int, batch_size: int, lr: float, seed: int) -> dict:
    torch.manual_seed(seed)
    write_tiny(family, out, seed=seed, **SIZES[family])
    loaded = load_model(str(out), device="cpu", dtype="float32")
    model = loaded.model.train()
    for p in model.parameters():
        p.requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(  # linear warm-up, then cosine decay to 0
        opt,
        lambda i: min(1.0, (i + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, i / steps))),
    )
    rng = random.Random(seed)
    stream = examples(seed, "train")
    make = llada_batch if family == "llada" else idlm_batch
    started, history = time.monotonic(), []
    for step in range(1, steps + 1):
        batch = make(loaded, [next(stream) for _ in range(batch_size)], rng)
        value = loss(model, batch)
        opt.zero_grad(set_to_none=True)
        value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == steps:
            history.append((step, round(value.item(), 4)))
            print(
                f"step {step}/{steps} loss {value.item():.4f} {time.monotonic() - started:.0f}s",
                flush=True,
            )
    model.eval()
    state = model.state_dict()
    tensors = {
        theirs: state[ours].detach().to(torch.bfloat16).contiguous()
        for theirs, ours in loaded.family.weight_map(model.config).items()
    }
    save_weights(out, tensors, num_shards=1)
    return {"steps": steps, "seconds": round(time.monotonic() - started), "loss": history[-5:]}


def evaluate(out: Path, family: str, n_addition: int = 300, n_other: int = 50) -> dict[str, float]:
    """Held-out exact match at temperature 0 with a 32-token canvas.

    LLaDA: one block, 32 steps. I-DLM: one token per step (block 1), which is greedy
    autoregressive decoding — what exact self-speculative verification returns at temperature 0.
    """
    block = 1 if family == "idlm" else 32
    params = DecodingParams(gen_length=32, steps=32, block_length=block)
    scores = {}
    with LLM(str(out), device="cpu", dtype="float32") as llm:
        for task in TASKS:
            exs = held_out_set(n_addition if task == "addition" else n_other, task=task)
            outs = llm.generate(
                [[{"role": "user", "content": e.question}] for e in exs],
                params,
            )
            right = sum(o.text.strip() == e.answer for o, e in zip(outs, exs, strict=True))
            scores[task] = round(right / len(exs), 4)
    return scores


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m dllm_serve.train", description=__doc__)
    p.add_argument("--family", choices=sorted(SIZES), required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=6000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    report = train(args.family, args.out, args.steps, args.batch_size, args.lr, args.seed)
    report["held_out_exact_match"] = evaluate(args.out, args.family)
    report["command"] = "python -m dllm_serve.train " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
    )
    (args.out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
