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
import shutil
import time
from pathlib import Path

import torch

from dllm_serve.api.protocol import ChatCompletionRequest
from dllm_serve.api.request_params import decoding_params
from dllm_serve.config import EngineConfig
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.llm import LLM
from dllm_serve.models.loader import load_model
from dllm_serve.models.tiny import write_tiny
from dllm_serve.models.tiny.files import save_weights
from dllm_serve.train.batches import BatchStream, batch_iterator
from dllm_serve.train.char_tokens import spell_words_and_numbers
from dllm_serve.train.model_card import machine, write_model_card
from dllm_serve.train.objectives import loss
from dllm_serve.train.tasks import STRATA, TASKS, WEIGHTS, held_out_additions, held_out_set

N_ADDITION, N_OTHER = 1000, 100  # held-out questions in the final evaluation
SIZES = {
    "llada": {"d_model": 192, "n_layers": 6, "n_heads": 6, "mlp_hidden_size": 512},
    "idlm": {"d_model": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "mlp_hidden_size": 384},
}


def sizes(
    family: str, d_model: int | None, n_layers: int | None, mlp: int | None, heads: int = 0
) -> dict:
    """The family's default size, with any overrides (heads of 32 dimensions unless
    ``heads`` is given; I-DLM keeps two query heads per KV head)."""
    out = dict(SIZES[family])
    if d_model:
        out |= {"d_model": d_model, "n_heads": d_model // 32}
    if heads:
        out["n_heads"] = heads
    if d_model or heads:
        if out["d_model"] % out["n_heads"]:
            raise SystemExit(f"d_model {out['d_model']} is not divisible by {out['n_heads']} heads")
        if "n_kv_heads" in out:
            out["n_kv_heads"] = max(1, out["n_heads"] // 2)
    if n_layers:
        out["n_layers"] = n_layers
    if mlp:
        out["mlp_hidden_size"] = mlp
    if family == "idlm":
        out["head_dim"] = out["d_model"] // out["n_heads"]
    return out


def write_skeleton(
    family: str, out: Path, seed: int, canvas: int, size: dict, rope_theta: float
) -> None:
    """A random checkpoint in the family's real format; its generation_config.json carries
    the canvas the model was trained for as ``max_new_tokens`` (the server's default).

    ``rope_theta``: the real checkpoints' 500000 / 1000000 suit head_dim 128 and long
    contexts; with 32-dimensional heads and 60-token rows only 3 or 4 of their 16 rotary
    frequencies turn noticeably, and a bidirectional model (no causal mask to count
    positions with) then barely knows where a token is. 0 keeps the format's value.
    """
    write_tiny(family, out, seed=seed, **size)
    if rope_theta:
        config_path = out / "config.json"
        config = json.loads(config_path.read_text())
        config["rope_theta"] = rope_theta
        config_path.write_text(json.dumps(config, indent=2) + "\n")
    gen_path = out / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    gen["max_new_tokens"] = canvas
    gen_path.write_text(json.dumps(gen, indent=2) + "\n")


def save(model: torch.nn.Module, loaded, out: Path) -> None:
    state = model.state_dict()
    tensors = {
        theirs: state[ours].detach().to("cpu", torch.bfloat16).contiguous()
        for theirs, ours in loaded.family.weight_map(model.config).items()
    }
    save_weights(out, tensors, num_shards=1)


def command_line(args: dict) -> str:
    """The command that repeats this run (flags set to True are bare; False/None/"" left out)."""
    parts = ["python -m dllm_serve.train"]
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            parts.append(flag)
        elif value not in (None, "", False):
            parts.append(f"{flag} {value}")
    return " ".join(parts)


def _parse_weights(text: str) -> dict[str, int]:
    """``reverse_word=4,sort=0`` → task weights (unknown tasks are an error)."""
    out = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if name not in TASKS:
            raise SystemExit(f"--weights: unknown task {name!r} (tasks: {', '.join(TASKS)})")
        out[name] = int(value)
    return out


def _as_tuple(drawn):
    return drawn if isinstance(drawn, tuple) else (drawn,)


def train(args: argparse.Namespace) -> dict:
    family, out, steps = args.family, args.out, args.steps
    torch.manual_seed(args.seed)
    size = sizes(family, args.d_model, args.n_layers, args.mlp, args.heads)
    write_skeleton(family, out, args.seed, args.canvas, size, args.rope_theta)
    if args.spell:
        spell_words_and_numbers(out)
    if args.init:  # continue from a trained checkpoint of the same shape (a second stage)
        shutil.copyfile(args.init / "model.safetensors", out / "model.safetensors")
    loaded = load_model(str(out), device="cpu", dtype="float32")
    weights = WEIGHTS | {"addition": args.addition_weight} | _parse_weights(args.weights)
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
    started, history, evals = time.monotonic(), [], []
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
    model.eval()
    save(model, loaded, out)
    report = {
        "steps": steps,
        "batch_size": args.batch_size,
        "addition_weight": args.addition_weight,
        "addition_operands": args.addition_operands,
        "task_weights": weights,
        "spelled": args.spell,
        "tail_rows": args.tail_rows if family == "llada" else None,
        "causal_steps": args.causal_steps if family == "llada" else None,
        "ar_fraction": args.ar_fraction if family == "llada" else None,
        "weighting": args.weighting if family == "llada" else None,
        "parameters": sum(p.numel() for p in model.parameters()),
        "seconds": round(time.monotonic() - started),
        "cpu_seconds": round(time.process_time() - cpu_started),
        "machine": machine(torch.get_num_threads(), args.device),
        "loss": history[-5:],
    }
    if evals:
        report["addition_during_training"] = evals
    return report


def evaluate(
    out: Path,
    family: str,
    device: str = "cpu",
    canvas: int = 32,
    n_addition: int = N_ADDITION,
    n_other: int = N_OTHER,
    tasks: tuple[str, ...] = tuple(TASKS),
    canvases: tuple[int, ...] = (),
) -> dict[str, float]:
    """Held-out exact match at temperature 0 through the serving engine.

    With ``canvases`` empty, the model's ``canvas`` at the server's default settings; else one
    score per canvas length, keyed ``task@canvas``, each at the settings a request of that
    ``max_tokens`` gets from the server (a canvas longer than ``canvas`` in blocks of about
    ``canvas``). Addition is scored per operand stratum (:data:`STRATA`, ``n_addition``
    questions split over them) as ``addition_1+1`` etc., and overall. LLaDA: one step per
    token. I-DLM: one token per step (block 1), greedy autoregressive decoding — what exact
    self-speculative verification returns at temperature 0.
    """
    scores: dict[str, float] = {}
    config = EngineConfig(max_running_requests=64, max_waiting_requests=1 << 20)
    sets: dict[str, list] = {}
    for task in tasks:
        if task == "addition":
            for name in STRATA:
                sets[f"addition_{name}"] = held_out_additions(name, n_addition // len(STRATA))
        else:
            sets[task] = held_out_set(n_other, task=task)
    with LLM(str(out), device=device, dtype="float32", engine_config=config) as llm:
        for length in canvases or (canvas,):
            suffix = f"@{length}" if canvases else ""
            params = server_params(length, canvas)
            right_adds = n_adds = 0
            for name, exs in sets.items():
                outs = llm.generate(
                    [[{"role": "user", "content": e.question}] for e in exs], params
                )
                right = sum(o.text.strip() == e.answer for o, e in zip(outs, exs, strict=True))
                scores[name + suffix] = round(right / len(exs), 4)
                if name.startswith("addition_"):
                    right_adds, n_adds = right_adds + right, n_adds + len(exs)
            if n_adds:
                scores["addition" + suffix] = round(right_adds / n_adds, 4)
    return scores


def server_params(length: int | None, trained: int = 32) -> DecodingParams:
    """The decoding a chat request with ``max_tokens`` = ``length`` (None: not set) gets from
    the server for a model trained on ``trained``-token canvases (its default canvas and
    block): the API's own rules (``api/request_params.py``), so the evaluation measures what
    users get. Self-speculative models ignore the canvas fields."""
    body: dict = {"messages": [{"role": "user", "content": "?"}]}
    if length is not None:
        body["max_tokens"] = length
    return decoding_params(ChatCompletionRequest.model_validate(body), trained, trained)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m dllm_serve.train", description=__doc__)
    p.add_argument("--family", choices=sorted(SIZES), required=True)
    p.add_argument("--out", type=Path, required=True)
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
        "--tail-rows",
        type=int,
        default=0,
        help="LLaDA: rows per step at long canvases (up to 1024, masked tail) so answers do "
        "not depend on max_tokens",
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
        help="LLaDA: share of each batch's rows that are two-stream autoregressive rows",
    )
    p.add_argument("--init", type=Path, help="start from this checkpoint's weights")
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers building batches")
    p.add_argument("--name", default="", help="model name in the card (default demo-FAMILY)")
    p.add_argument("--eval-every", type=int, default=0, help="held-out addition every N steps")
    args = p.parse_args(argv)
    if args.causal_steps and args.family != "llada":
        p.error("--causal-steps is for --family llada (the I-DLM objective is always causal)")
    if args.ar_fraction and args.family != "llada":
        p.error("--ar-fraction is for --family llada")
    if not 0.0 <= args.ar_fraction <= 1.0:
        p.error("--ar-fraction must be between 0 and 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    report = train(args)
    canvases = tuple(int(c) for c in filter(None, args.eval_canvases.split(",")))
    trained = tuple(t for t, w in report["task_weights"].items() if w)  # untrained: not scored
    report["held_out_exact_match"] = evaluate(
        args.out, args.family, args.device, args.canvas, tasks=trained, canvases=canvases
    )
    if args.init and (args.init / "training_report.json").is_file():
        first = json.loads((args.init / "training_report.json").read_text())
        report["init_from"] = {
            k: first[k] for k in ("command", "steps", "seconds", "cpu_seconds") if k in first
        }
    report["held_out_counts"] = {
        **{f"addition_{n}": len(held_out_additions(n, N_ADDITION // len(STRATA))) for n in STRATA},
        **{t: len(held_out_set(N_OTHER, task=t)) for t in trained if t != "addition"},
    }
    report["command"] = command_line(vars(args))
    (args.out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    write_model_card(args.out, args.name or f"demo-{args.family}", args.family, report)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
