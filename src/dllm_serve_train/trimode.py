"""The tri-mode demo's second stage and its evaluation (``--family nemotron``).

Stage 1 is the generic loop (``train/loop.py``) with the joint AR + block-diffusion objective
(``train/trimode_objective.py``). :func:`finish` then trains the draft LoRA on the frozen
model (``train/draft_lora.py``), writes it in PEFT format under ``OUT/draft-lora``, evaluates
every decoding mode on held-out questions (``train/trimode_eval.py``) and writes the card.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch

from dllm_serve.models.loader import load_model
from dllm_serve_train.draft_lora import TrainableDraftLoRA
from dllm_serve_train.model_card import write_trimode_card
from dllm_serve_train.objectives import loss
from dllm_serve_train.tasks import examples
from dllm_serve_train.trimode_eval import evaluate_modes, evaluate_phrasings_by_mode
from dllm_serve_train.trimode_objective import block_positions, trimode_batch

LORA_DIR = "draft-lora"


def train_draft_lora(args: argparse.Namespace, weights: dict[str, int]) -> dict:
    """The draft LoRA stage: ``args.lora_steps`` AdamW steps on LinearSpec drafts only."""
    out = Path(args.out)
    loaded = load_model(str(out), device="cpu", dtype="float32")
    model = loaded.model.train()
    for p in model.parameters():
        p.requires_grad_(False)
    lora = TrainableDraftLoRA(model, args.lora_rank, 4.0 * args.lora_rank, args.seed + 7)
    block = int(loaded.config["block_size"])
    stream = examples(args.seed + 7, "train", weights=weights,
                      addition_operands=args.addition_operands, ramp_examples=1,
                      phrasing=args.phrasing, context=args.context,
                      composed=args.composed,
                      unfamiliar_verbs=args.unfamiliar_verbs)  # fmt: skip
    rng = random.Random(args.seed + 7)
    opt = torch.optim.AdamW(lora.parameters(), lr=args.lora_lr, weight_decay=0.0)
    steps = args.lora_steps
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: 0.5 * (1 + math.cos(math.pi * min(1.0, i / steps)))
    )
    started, cpu_started, history = time.monotonic(), time.process_time(), []
    for step in range(1, steps + 1):
        batch = trimode_batch(
            loaded, [next(stream) for _ in range(args.batch_size)], rng, block, lora_stage=True
        )
        lora.token_mask = block_positions(batch, block)
        value = loss(model, batch)
        opt.zero_grad(set_to_none=True)
        value.backward()
        torch.nn.utils.clip_grad_norm_(lora.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == steps:
            history.append((step, round(value.item(), 4)))
            print(f"lora step {step}/{steps} loss {value.item():.4f}", flush=True)
    lora.remove()
    lora.save(out / LORA_DIR, out.name)
    return {
        "steps": steps,
        "rank": args.lora_rank,
        "alpha": 4.0 * args.lora_rank,
        "lr": args.lora_lr,
        "seconds": round(time.monotonic() - started),
        "cpu_seconds": round(time.process_time() - cpu_started),
        "loss": history[-5:],
    }


def finish(args: argparse.Namespace, report: dict, command: str) -> dict:
    """Stage 2, the evaluation per mode and the card; returns the completed report."""
    out = Path(args.out)
    weights = report["task_weights"]
    if args.lora_steps:
        report["draft_lora"] = train_draft_lora(args, weights)
    # Off-topic questions are scored with the phrasings, not as a task of their own.
    trained = tuple(t for t, w in weights.items() if w and t != "off_topic")
    lora_dir = out / LORA_DIR if args.lora_steps else None
    results = evaluate_modes(out, lora_dir, trained, args.eval_questions, args.eval_questions)
    answers = {mode: r.pop("answers") for mode, r in results.items()}
    for mode in ("linear_spec", "linear_spec+lora"):
        if mode in answers:  # exactness at T = 0, on every held-out question
            results[mode]["same_answers_as_ar"] = sum(
                a == b for a, b in zip(answers[mode], answers["ar"], strict=True)
            )
    results["questions"] = len(answers["ar"])
    report["held_out_by_mode"] = results
    if args.phrasing or weights.get("off_topic"):
        report["held_out_phrasings"] = evaluate_phrasings_by_mode(out, lora_dir)
    report["command"] = command
    (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    write_trimode_card(out, args.name or "demo-trimode", report)
    return report
