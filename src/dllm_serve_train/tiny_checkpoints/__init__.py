"""Tiny random-weight checkpoints in the real on-disk formats of each supported family.

``write_tiny(family, DIR, ...)`` (or ``write_tiny_llada`` / ``write_tiny_dream`` /
``write_tiny_idlm`` / ``write_tiny_sdar`` / ``write_tiny_llada2`` / ``write_tiny_lladamoe`` /
``write_tiny_fastdllm`` / ``write_tiny_nemotron``) writes a complete checkpoint whose config,
tokenizer files and chat template reproduce the real ones, with only sizes (and, for the small
default vocabulary, special ids) changed. Output is a pure function of the arguments.

Command line: ``python -m dllm_serve_train.tiny_checkpoints
[--family llada|dream|idlm|sdar|llada2|lladamoe|fastdllm|nemotron|diffusion_gemma] DIR
[--d-model N ...] [--real-ids]`` (nemotron: ``[--draft-lora-out DIR]``; ``dllm-serve
make-tiny`` forwards its arguments here).
"""

from __future__ import annotations

import argparse
import inspect
import shutil
import textwrap
from collections.abc import Callable
from pathlib import Path

from dllm_serve.arg_types import at_least, new_or_empty_dir
from dllm_serve_train.tiny_checkpoints.bpe import build_tokenizer
from dllm_serve_train.tiny_checkpoints.diffusion_gemma import write_tiny_diffusion_gemma
from dllm_serve_train.tiny_checkpoints.llada import (
    CHAT_TEMPLATE,
    llada_special_tokens,
    write_tiny_llada,
)
from dllm_serve_train.tiny_checkpoints.llada2 import write_tiny_llada2
from dllm_serve_train.tiny_checkpoints.lladamoe import write_tiny_lladamoe
from dllm_serve_train.tiny_checkpoints.nemotron import write_tiny_draft_lora, write_tiny_nemotron
from dllm_serve_train.tiny_checkpoints.qwen import (
    write_tiny_dream,
    write_tiny_fastdllm,
    write_tiny_idlm,
    write_tiny_sdar,
)

__all__ = [
    "CHAT_TEMPLATE",
    "FORMATS",
    "WRITERS",
    "build_tokenizer",
    "llada_special_tokens",
    "main",
    "write_tiny",
    "write_tiny_diffusion_gemma",
    "write_tiny_draft_lora",
    "write_tiny_dream",
    "write_tiny_fastdllm",
    "write_tiny_idlm",
    "write_tiny_llada",
    "write_tiny_llada2",
    "write_tiny_lladamoe",
    "write_tiny_nemotron",
    "write_tiny_sdar",
]

WRITERS: dict[str, Callable[..., Path]] = {
    "llada": write_tiny_llada,
    "dream": write_tiny_dream,
    "idlm": write_tiny_idlm,
    "sdar": write_tiny_sdar,
    "llada2": write_tiny_llada2,
    "lladamoe": write_tiny_lladamoe,
    "fastdllm": write_tiny_fastdllm,
    "nemotron": write_tiny_nemotron,
    "diffusion_gemma": write_tiny_diffusion_gemma,
}
# The on-disk format each family's checkpoint reproduces (`make-tiny --help`).
FORMATS: dict[str, str] = {
    "llada": "LLaDA-8B-Instruct: LLaDA config and tensor names, tokenizer.json",
    "dream": "Dream-v0-Instruct-7B: Dream config, Qwen2 tensors, vocab.json + merges.txt",
    "idlm": "I-DLM-8B: SDAR config, Qwen3 tensors, vocab.json + merges.txt",
    "sdar": "SDAR/TraDo block diffusion: I-DLM's files, use_regular_causal false, block_size",
    "llada2": "LLaDA2.x MoE block diffusion: llada2_moe config, per-expert tensors, tokenizer.json",
    "lladamoe": "LLaDA-MoE-7B-A1B: llada config with MoE keys, per-expert tensors, tokenizer.json",
    "fastdllm": "Fast-dLLM v2 7B: Fast_dLLM_Qwen config (bd_size), Qwen2 tensors, vocab.json",
    "nemotron": "Nemotron-Labs-Diffusion tri-mode: encoder.* + diffusion_head, YaRN; draft LoRA",
    "diffusion_gemma": "DiffusionGemma: text_config, model.decoder.* + encoder scalars, vision",
}


def write_tiny(family: str, out_dir: str | Path, **sizes: int | bool | str | None) -> Path:
    """Write a tiny checkpoint of ``family`` (a key of :data:`WRITERS`) to ``out_dir``."""
    if family not in WRITERS:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(WRITERS)}")
    return WRITERS[family](out_dir, **sizes)


def _description(family: str) -> str:
    """make-tiny's help text: every family's format, and whose size flags follow."""
    others = [f for f in WRITERS if f != family]
    intro = (
        "Write a tiny random-weight checkpoint (for tests and smoke runs; its answers are "
        "gibberish) in the real on-disk format of one family, chosen with --family:"
    )
    outro = (
        f"The size flags below are those of --family {family}; for the others' run "
        + " or ".join(f"`dllm-serve make-tiny --family {f} --help`" for f in others)
        + ". Every file is written with mode 0644 and the directory 0755 (readable by any "
        "user, e.g. a container's)."
    )
    formats = [f"  {name:<6} {fmt}" for name, fmt in FORMATS.items()]
    fill = textwrap.TextWrapper(79, break_on_hyphens=False).fill
    return "\n".join([fill(intro), *formats, fill(outro)])


# What each writer's boolean keyword does, as its make-tiny flag says it.
BOOL_FLAGS = {
    "real_ids": "keep the real special ids and vocab",
    "editing": "LLaDA2.1-style: token editing (S mode) as the checkpoint's default decoding",
    "levenshtein": "LLaDA2.2-style: DELETE/SPLIT edit tokens (insert/delete decoding, S mode "
    "by default) and block routing (expert_capacity)",
}


def main(argv: list[str] | None = None) -> int:
    """Command line: ``[--family F] DIR [--d-model N ...] [--real-ids]``."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--family", choices=list(WRITERS), default="llada")
    known, _ = pre.parse_known_args(argv)
    writer = WRITERS[known.family]
    p = argparse.ArgumentParser(
        prog="dllm-serve make-tiny",
        description=_description(known.family),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--family", choices=list(WRITERS), default="llada", help="default: llada")
    p.add_argument(
        "out_dir",
        type=new_or_empty_dir,
        help="directory to write: new or empty (created if missing)",
    )
    for name, param in inspect.signature(writer).parameters.items():
        if param.kind is not inspect.Parameter.KEYWORD_ONLY:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(param.default, bool):
            p.add_argument(flag, action="store_true", help=BOOL_FLAGS.get(name, name))
        elif param.default is None:  # an optional path (nemotron's --draft-lora-out)
            p.add_argument(
                flag, metavar="DIR", type=new_or_empty_dir, help="also write a draft LoRA here"
            )
        else:
            p.add_argument(
                flag,
                type=at_least(min(param.default, 1)),
                default=param.default,
                help=f"default {param.default}",
            )
    args = vars(p.parse_args(argv))
    args.pop("family")
    out = args.pop("out_dir")  # new or empty (its argparse type), as --draft-lora-out
    targets = [out] + ([args["draft_lora_out"]] if args.get("draft_lora_out") else [])
    existed = [t for t in targets if t.exists()]
    try:
        print(writer(out, **args))
    except (ValueError, OSError) as exc:
        # Sizes that do not fit together (a d_model its heads do not divide, ...): one line,
        # and no half-written checkpoint left behind (an empty directory stays empty).
        for target in targets:
            shutil.rmtree(target, ignore_errors=True)
            if target in existed:
                target.mkdir(exist_ok=True)
        p.error(str(exc))
    return 0
