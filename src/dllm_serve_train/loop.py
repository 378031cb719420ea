"""One training run: the checkpoint skeleton in the family's real format, the optimisation
loop on the task mix, and the weights saved under the family's tensor names."""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import time
from pathlib import Path

import torch

from dllm_serve.models.loader import load_model
from dllm_serve_train.arguments import parse_weights
from dllm_serve_train.batches import BatchStream, batch_iterator
from dllm_serve_train.char_tokens import spell_words_and_numbers
from dllm_serve_train.evaluation import evaluate, evaluate_phrasings
from dllm_serve_train.model_card import machine
from dllm_serve_train.objectives import loss
from dllm_serve_train.phrasings import phrasing_counts
from dllm_serve_train.skeleton import sizes, write_skeleton
from dllm_serve_train.tasks import WEIGHTS
from dllm_serve_train.tiny_checkpoints.files import save_weights


def save(model: torch.nn.Module, loaded, out: Path) -> None:
    state = model.state_dict()
    tensors = {
        theirs: state[ours].detach().to("cpu", torch.bfloat16).contiguous()
        for theirs, ours in loaded.family.weight_map(model.config).items()
    }
    save_weights(out, tensors, num_shards=1)


def earlier_stages(init: Path) -> dict | None:
    """The record of the run that wrote ``init`` (its own earlier stages nested under
    ``init_from``), for a run that continues from it; None when ``init`` has no report."""
    path = init / "training_report.json"
    if not path.is_file():
        return None
    first = json.loads(path.read_text())
    keys = ("command", "steps", "seconds", "cpu_seconds", "init_from", "draft_lora")
    return {k: first[k] for k in keys if k in first}


def grown_state(state: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """A model's weights (the server's own names) spread over ``n_layers`` layers, for
    ``--grow-layers``: layer ``j`` starts as a copy of layer ``j * n / n_layers`` of the ``n``
    given, and every repeat of a layer has its attention and MLP output projections zeroed.
    In a pre-norm residual block a layer whose two outputs are zero adds nothing to the
    residual stream, so the grown model computes exactly the smaller one's function at step
    0; the zeroed projections get gradients at once, and the copied queries, keys and MLP
    inputs start from features the smaller model already uses (rather than from noise)."""
    layer = re.compile(r"^layers\.(\d+)\.(.+)$")
    n = 1 + max(int(m.group(1)) for m in map(layer.match, state) if m)
    if n_layers <= n:
        raise ValueError(f"--grow-layers: the model to grow has {n} layers, --n-layers {n_layers}")
    outputs = ("attn.o_proj.", "mlp.down_proj.")  # with their biases, where a model has them
    if not all(f"layers.0.{o}weight" in state for o in outputs):
        raise ValueError("--grow-layers: only dense models (an o_proj and a down_proj per layer)")
    grown = {k: v.clone() for k, v in state.items() if not layer.match(k)}
    for j in range(n_layers):
        source = j * n // n_layers
        repeat = j > 0 and (j - 1) * n // n_layers == source
        for name, weight in state.items():
            m = layer.match(name)
            if m and int(m.group(1)) == source:
                rest = m.group(2)
                zero = repeat and rest.startswith(outputs)
                grown[f"layers.{j}.{rest}"] = torch.zeros_like(weight) if zero else weight.clone()
    return grown


def _as_tuple(drawn):
    return drawn if isinstance(drawn, tuple) else (drawn,)


def train(args: argparse.Namespace) -> dict:
    family, out, steps = args.family, args.out, args.steps
    torch.manual_seed(args.seed)
    kv_heads = getattr(args, "kv_heads", 0)
    size = sizes(family, args.d_model, args.n_layers, args.mlp, args.heads, kv_heads)
    write_skeleton(
        family, out, args.seed, args.canvas, size, args.rope_theta, getattr(args, "block_size", 0)
    )
    if args.spell:
        spell_words_and_numbers(out)
    grow = getattr(args, "grow_layers", False)
    if args.init and not grow:  # a second stage: a checkpoint of the same shape
        shutil.copyfile(args.init / "model.safetensors", out / "model.safetensors")
    loaded = load_model(str(out), device="cpu", dtype="float32")
    if grow:
        smaller = load_model(str(args.init), device="cpu", dtype="float32").model.state_dict()
        loaded.model.load_state_dict(grown_state(smaller, loaded.model.config.n_layers))
    weights = WEIGHTS | {"addition": args.addition_weight} | parse_weights(args.weights)
    dataset = BatchStream(
        loaded,
        family,
        args.seed,
        args.batch_size,
        weights,
        args.canvas,
        args.weighting,
        args.addition_operands,
        # The short-operand share reaches zero at 3/4 of the run: the last quarter trains on
        # the held-out distribution only.
        ramp_examples=int(0.75 * steps * args.batch_size),
        causal_batches=args.causal_steps,
        ar_fraction=args.ar_fraction,
        tail_rows=args.tail_rows,
        tail_min_canvas=getattr(args, "tail_min_canvas", 0),
        phrasing=getattr(args, "phrasing", 0.0),
        context=getattr(args, "context", 0.0),
        composed=getattr(args, "composed", 0.0),
        unfamiliar_verbs=getattr(args, "unfamiliar_verbs", 0.0),
        consistency=getattr(args, "consistency", 0.0),
    )
    batches = batch_iterator(dataset, args.workers)  # before any CUDA use (workers fork)
    model = loaded.model.to(args.device).train()
    for p in model.parameters():
        p.requires_grad_(True)
    lr = args.lr
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(  # linear warm-up, then cosine decay to 0
        opt,
        lambda i: min(1.0, (i + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, i / steps))),
    )
    started, history, evals, report_phrasings = time.monotonic(), [], [], []
    cpu_started = time.process_time()  # the budget is CPU time: wall time grows on a shared box
    for step in range(1, steps + 1):
        drawn = next(batches)
        value = loss(model, *(b.to(args.device) for b in _as_tuple(drawn)))
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
        if args.eval_every and step % args.eval_every == 0 and step < steps:
            save(model, loaded, out)
            acc = evaluate(out, family, args.device, args.canvas, 200, tasks=("addition",))
            evals.append((step, acc["addition"]))
            print(f"step {step} held-out addition {acc['addition']:.3f}", flush=True)
            if getattr(args, "phrasing", 0.0):
                phrased = evaluate_phrasings(out, args.device, args.canvas, n=60)
                shares = {k: round(v["right"] / v["of"], 3) for k, v in phrased.items()}
                report_phrasings.append((step, shares))
                print(f"step {step} held-out phrasings {shares}", flush=True)
    model.eval()
    save(model, loaded, out)
    report = {
        "steps": steps,
        "batch_size": args.batch_size,
        "addition_weight": args.addition_weight,
        "addition_operands": args.addition_operands,
        "task_weights": weights,
        "spelled": args.spell,
        "phrasing": getattr(args, "phrasing", 0.0),
        "context": getattr(args, "context", 0.0),
        "composed": getattr(args, "composed", 0.0),
        "unfamiliar_verbs": getattr(args, "unfamiliar_verbs", 0.0),
        "consistency": getattr(args, "consistency", 0.0),
        "tail_rows": args.tail_rows if family == "llada" else None,
        "tail_min_canvas": getattr(args, "tail_min_canvas", 0) if family == "llada" else None,
        "causal_steps": args.causal_steps if family == "llada" else None,
        "ar_fraction": args.ar_fraction if family in ("llada", "idlm") else None,
        "weighting": args.weighting if family == "llada" else None,
        "parameters": sum(p.numel() for p in model.parameters()),
        "seconds": round(time.monotonic() - started),
        "cpu_seconds": round(time.process_time() - cpu_started),
        "machine": machine(torch.get_num_threads(), args.device),
        "loss": history[-5:],
    }
    if report["phrasing"]:
        report["phrasing_templates"] = phrasing_counts()
    if evals:
        report["addition_during_training"] = evals
    if report_phrasings:
        report["phrasings_during_training"] = report_phrasings
    return report
