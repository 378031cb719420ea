"""The training command's arguments, checked before anything is written.

A bad value must be a one-line ``parser.error`` (exit 2) before the run starts, not a traceback
from deep inside it (``--steps 0`` would divide by zero in the learning-rate schedule) or a
failure after training has finished (``--eval-canvases abc``). Every check here runs first,
and ``--out`` must be new or empty, so a run never mixes its files with an older
checkpoint's, nor writes a random skeleton over a trained one (``--init X --out X``).
"""

from __future__ import annotations

import argparse
import math

import torch

from dllm_serve_train.skeleton import check_model_files
from dllm_serve_train.tasks import TASKS, WEIGHTS

# flag → the smallest value it accepts (0 means "the family's default" or "off" for most).
_AT_LEAST = {
    "steps": 1,
    "batch_size": 1,
    "canvas": 1,
    "d_model": 0,
    "n_layers": 0,
    "mlp": 0,
    "heads": 0,
    "kv_heads": 0,
    "threads": 0,
    "workers": 0,
    "addition_weight": 0,
    "tail_rows": 0,
    "tail_min_canvas": 0,
    "causal_steps": 0,
    "eval_every": 0,
    "block_size": 0,
    "lora_steps": 0,
    "lora_rank": 1,
    "eval_questions": 1,
}
# The longest canvas a --tail-rows row is drawn at (objectives.llada_tail_batch's default).
TAIL_MAX_CANVAS = 1024
_LLADA_ONLY = ("causal_steps", "tail_rows", "tail_min_canvas")


def parse_weights(text: str) -> dict[str, int]:
    """``reverse_word=4,sort_word=0`` → task weights; raises ValueError naming the problem."""
    out = {}
    for item in filter(None, text.split(",")):
        name, equals, value = item.partition("=")
        if name not in TASKS:
            raise ValueError(f"unknown task {name!r} (tasks: {', '.join(TASKS)})")
        if not equals or not value.strip().isdigit():
            raise ValueError(f"{item!r}: write TASK=N with a whole number N >= 0")
        out[name] = int(value)
    return out


def parse_canvases(text: str) -> tuple[int, ...]:
    """``32,256,1024`` → canvas lengths; raises ValueError naming the problem."""
    canvases = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        if not item.isdigit() or int(item) < 1:
            raise ValueError(f"{item!r} is not a canvas length (a whole number >= 1)")
        canvases.append(int(item))
    return tuple(canvases)


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every value a run needs, or ``parser.error`` (exit 2, one line) before any file is
    written."""
    for name, least in _AT_LEAST.items():
        if getattr(args, name) < least:
            parser.error(f"--{name.replace('_', '-')} must be >= {least}")
    for name in ("lr", "lora_lr"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            parser.error(f"--{name.replace('_', '-')} must be a finite number > 0")
    if not (math.isfinite(args.rope_theta) and args.rope_theta >= 0):
        parser.error("--rope-theta must be a finite number >= 0 (0: the format's own)")
    for name in ("ar_fraction", "phrasing", "context", "composed", "unfamiliar_verbs"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            parser.error(f"--{name.replace('_', '-')} must be between 0 and 1")
    if args.family != "nemotron" and (args.block_size or args.lora_steps):
        parser.error("--block-size and --lora-steps are for --family nemotron")
    if args.family != "llada":
        for name in _LLADA_ONLY:
            if getattr(args, name):
                parser.error(
                    f"--{name.replace('_', '-')} is for --family llada (the I-DLM and tri-mode "
                    "objectives are causal)"
                )
    if args.family == "nemotron" and args.ar_fraction:
        parser.error(
            "--ar-fraction is for --family llada and idlm (the tri-mode objective trains every "
            "row autoregressively already)"
        )
    # Values that would do nothing, or be clamped, are refused rather than ignored.
    if args.composed and not args.phrasing:
        parser.error("--composed is a share of the phrased reversals: add --phrasing")
    if args.unfamiliar_verbs and not args.composed:
        parser.error("--unfamiliar-verbs is a share of the composed reversals: add --composed")
    if not (math.isfinite(args.consistency) and args.consistency >= 0):
        parser.error("--consistency must be a finite number >= 0")
    if args.consistency and not args.context:
        parser.error("--consistency pairs rows asked after a context: add --context")
    if args.tail_min_canvas and not args.tail_rows:
        parser.error("--tail-min-canvas sets the shortest canvas of --tail-rows rows: add it")
    if args.tail_min_canvas > TAIL_MAX_CANVAS:
        parser.error(f"--tail-min-canvas must be <= {TAIL_MAX_CANVAS} (the longest tail canvas)")
    try:
        weights = WEIGHTS | {"addition": args.addition_weight} | parse_weights(args.weights)
    except ValueError as exc:
        parser.error(f"--weights: {exc}")
    if not any(weights.values()):
        parser.error("every task weight is 0: at least one task must be trained")
    try:
        canvases = parse_canvases(args.eval_canvases)
    except ValueError as exc:
        parser.error(f"--eval-canvases: {exc}")
    if args.device != "cpu":
        try:
            device = torch.device(args.device)
        except RuntimeError as exc:
            parser.error(f"--device: {exc}")
        if device.type != "cuda" or not torch.cuda.is_available():
            parser.error(f"--device {args.device}: use cpu, or cuda on a machine with a GPU")
    if args.init is not None and not (args.init / "model.safetensors").is_file():
        parser.error(f"--init {args.init}: no model.safetensors there")
    if args.grow_layers and args.init is None:
        parser.error("--grow-layers needs --init (the checkpoint to grow)")
    check_model_files(parser, args, canvases)
    out = args.out  # new or empty (its argparse type)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.error(f"--out {out}: {exc}")
