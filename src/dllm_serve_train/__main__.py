"""Train a demo model: ``python -m dllm_serve_train --family {llada,idlm,nemotron} --out DIR``.

Writes a tiny checkpoint skeleton in the family's real format (config, tokenizer, template),
trains its weights on the task mix from a fixed seed for a fixed number of steps (so the run
is reproducible), saves them under the family's tensor names, and evaluates held-out
exact-match accuracy at default request settings (temperature 0) through the serving engine.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dllm_serve.arg_types import new_or_empty_dir
from dllm_serve_train.arguments import check_arguments, parse_canvases
from dllm_serve_train.evaluation import (
    N_ADDITION,
    N_OTHER,
    evaluate,
    evaluate_phrasings,
    server_params,
)
from dllm_serve_train.loop import earlier_stages, train
from dllm_serve_train.model_card import write_model_card
from dllm_serve_train.skeleton import SIZES
from dllm_serve_train.tasks import STRATA, WEIGHTS, held_out_additions, held_out_set
from dllm_serve_train.trimode import finish

# server_params is imported from here by tests (the evaluation's decoding settings).
__all__ = ["main", "server_params"]


# Flags that only a tri-mode run reads: left out of other families' commands.
_TRI_MODE_ONLY = ("block_size", "lora_steps", "lora_rank", "lora_lr", "eval_questions")


def command_line(args: dict, defaults: dict) -> str:
    """The command that repeats this run: every flag whose value is not its default (a flag
    set to True is bare). A 0 is written too when the default is not 0: left out, the recorded
    command would train with the default (``--addition-weight 0`` would become weight 4)."""
    parts = ["python -m dllm_serve_train"]
    for key, value in args.items():
        if key in _TRI_MODE_ONLY and args.get("family") != "nemotron":
            continue
        if key in defaults and value == defaults[key] and type(value) is type(defaults[key]):
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            parts.append(flag)
        elif value is not None and value is not False:
            parts.append(f"{flag} {value}")
    return " ".join(parts)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m dllm_serve_train", description=__doc__)
    p.add_argument("--family", choices=sorted(SIZES), required=True)
    p.add_argument("--out", type=new_or_empty_dir, required=True)
    p.add_argument("--steps", type=int, default=6000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--d-model", type=int, default=0, help="override the family's size")
    p.add_argument("--n-layers", type=int, default=0)
    p.add_argument("--mlp", type=int, default=0, help="MLP hidden size")
    p.add_argument("--heads", type=int, default=0, help="attention heads (0: d_model / 32)")
    p.add_argument(
        "--kv-heads", type=int, default=0, help="I-DLM, tri-mode: KV heads (0: half the heads)"
    )
    p.add_argument(
        "--addition-weight",
        type=int,
        default=WEIGHTS["addition"],
        help="addition's share against weight 1 for each other task",
    )
    p.add_argument(
        "--addition-operands",
        choices=["uniform", "mixed", "curriculum", "stratified"],
        default="uniform",
        help="training additions: uniform 0-999; mixed: half with a uniform digit count; "
        "curriculum: all short-first, falling to none at 3/4 of the steps; "
        "stratified: each operand's digit count 1-3 drawn first (the held-out strata)",
    )
    p.add_argument(
        "--weights",
        default="",
        help="other task weights, e.g. reverse_word=4,sort_word=2 (default: 1 each, 0 for "
        "the word tasks)",
    )
    p.add_argument(
        "--spell",
        action="store_true",
        help="one token per letter and digit (drop the BPE's word and number merges)",
    )
    p.add_argument(
        "--phrasing",
        type=float,
        default=0.0,
        help="share of additions and reversals asked in a random training phrasing "
        "(dllm_serve_train/phrasings.py) with case, punctuation and spacing varied",
    )
    p.add_argument(
        "--context",
        type=float,
        default=0.0,
        help="share of examples asked after a system prompt and/or earlier turns",
    )
    p.add_argument(
        "--composed",
        type=float,
        default=0.0,
        help="share of phrased reversals asked in a phrasing composed from parts "
        "(dllm_serve_train/composed.py) rather than a written one",
    )
    p.add_argument(
        "--unfamiliar-verbs",
        type=float,
        default=0.0,
        help="share of the composed reversals whose verb is another word of the task "
        "('Plant me {w} backwards.'), so that an unseen verb is not taken for the word",
    )
    p.add_argument(
        "--consistency",
        type=float,
        default=0.0,
        help="weight of a term that makes an answer after a context the answer alone: "
        "KL(alone || after) over up to a quarter of each batch's rows with --context, each "
        "also built without its context (one more forward per step)",
    )
    p.add_argument(
        "--tail-rows",
        type=int,
        default=0,
        help="LLaDA: rows per step at long canvases (up to 1024, masked tail) so answers do "
        "not depend on max_tokens",
    )
    p.add_argument(
        "--tail-min-canvas",
        type=int,
        default=0,
        help="LLaDA: the shortest canvas of the --tail-rows rows (default: their block)",
    )
    p.add_argument(
        "--eval-canvases",
        default="",
        help="comma-separated canvas lengths for the final evaluation, e.g. 32,256,1024",
    )
    p.add_argument("--canvas", type=int, default=32, help="default canvas (max_new_tokens)")
    p.add_argument("--rope-theta", type=float, default=0.0, help="0: the format's own")
    p.add_argument(
        "--weighting",
        choices=["token_mean", "row_mean", "inverse_t"],
        default="token_mean",
        help="LLaDA loss weighting (see objectives.llada_batch)",
    )
    p.add_argument(
        "--causal-steps",
        type=int,
        default=0,
        help="LLaDA: train the first N steps with a causal mask, then bidirectionally",
    )
    p.add_argument(
        "--ar-fraction",
        type=float,
        default=0.0,
        help="share of each batch's rows trained autoregressively on the whole answer "
        "(LLaDA: two-stream rows; I-DLM: the answer clean, no MASK)",
    )
    p.add_argument("--init", type=Path, help="start from this checkpoint's weights")
    p.add_argument(
        "--grow-layers",
        action="store_true",
        help="--init has fewer layers than --n-layers: added layers start as identity copies",
    )
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers building batches")
    p.add_argument("--name", default="", help="model name in the card (default demo-FAMILY)")
    p.add_argument("--eval-every", type=int, default=0, help="held-out addition every N steps")
    p.add_argument("--block-size", type=int, default=0, help="nemotron: diffusion block")
    p.add_argument("--lora-steps", type=int, default=0, help="nemotron: draft-LoRA steps")
    p.add_argument("--lora-rank", type=int, default=8, help="nemotron: draft-LoRA rank")
    p.add_argument("--lora-lr", type=float, default=1e-3, help="nemotron: draft-LoRA lr")
    p.add_argument("--eval-questions", type=int, default=100, help="nemotron: held-out per set")
    args = p.parse_args(argv)
    check_arguments(p, args)
    defaults = {a.dest: a.default for a in p._actions}
    if args.threads:
        torch.set_num_threads(args.threads)
    report = train(args)
    if args.init and (earlier := earlier_stages(args.init)):  # the whole chain of stages
        report["init_from"] = earlier
    if args.family == "nemotron":  # the draft LoRA, then every decoding mode evaluated
        print(json.dumps(finish(args, report, command_line(vars(args), defaults)), indent=2))
        return
    canvases = parse_canvases(args.eval_canvases)
    # Untrained tasks are not scored; off-topic questions are scored with the phrasings.
    trained = tuple(t for t, w in report["task_weights"].items() if w and t != "off_topic")
    report["held_out_exact_match"] = evaluate(
        args.out, args.family, args.device, args.canvas, tasks=trained, canvases=canvases
    )
    if args.phrasing or report["task_weights"].get("off_topic"):
        report["held_out_phrasings"] = evaluate_phrasings(args.out, args.device, args.canvas)
    report["held_out_counts"] = {
        **{f"addition_{n}": len(held_out_additions(n, N_ADDITION // len(STRATA))) for n in STRATA},
        **{t: len(held_out_set(N_OTHER, task=t)) for t in trained if t != "addition"},
    }
    report["command"] = command_line(vars(args), defaults)
    (args.out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    write_model_card(args.out, args.name or f"demo-{args.family}", args.family, report)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
