"""Tiny random-weight checkpoints in the real on-disk formats of each supported family.

``write_tiny(family, DIR, ...)`` (or ``write_tiny_llada`` / ``write_tiny_dream`` /
``write_tiny_idlm``) writes a complete checkpoint whose config, tokenizer files and chat
template reproduce the real ones, with only sizes (and, for the small default vocabulary,
special ids) changed. Output is a pure function of the arguments.

Command line: ``python -m dllm_serve.models.tiny [--family llada|dream|idlm] DIR [--d-model N
...] [--real-ids]`` (``dllm-serve make-tiny`` forwards its arguments here).
"""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable
from pathlib import Path

from dllm_serve.models.tiny.bpe import build_tokenizer
from dllm_serve.models.tiny.llada import CHAT_TEMPLATE, llada_special_tokens, write_tiny_llada
from dllm_serve.models.tiny.qwen import write_tiny_dream, write_tiny_idlm

__all__ = [
    "CHAT_TEMPLATE",
    "WRITERS",
    "build_tokenizer",
    "llada_special_tokens",
    "main",
    "write_tiny",
    "write_tiny_dream",
    "write_tiny_idlm",
    "write_tiny_llada",
]

WRITERS: dict[str, Callable[..., Path]] = {
    "llada": write_tiny_llada,
    "dream": write_tiny_dream,
    "idlm": write_tiny_idlm,
}


def write_tiny(family: str, out_dir: str | Path, **sizes: int | bool) -> Path:
    """Write a tiny checkpoint of ``family`` (llada, dream or idlm) to ``out_dir``."""
    if family not in WRITERS:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(WRITERS)}")
    return WRITERS[family](out_dir, **sizes)


def main(argv: list[str] | None = None) -> int:
    """Command line: ``[--family F] DIR [--d-model N ...] [--real-ids]``."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--family", choices=list(WRITERS), default="llada")
    known, _ = pre.parse_known_args(argv)
    writer = WRITERS[known.family]
    p = argparse.ArgumentParser(
        prog="dllm-serve make-tiny",
        description=f"{writer.__doc__} Families: {', '.join(WRITERS)}.",
    )
    p.add_argument("--family", choices=list(WRITERS), default="llada", help="default: llada")
    p.add_argument("out_dir", help="directory to write (created if missing)")
    for name, param in inspect.signature(writer).parameters.items():
        if param.kind is not inspect.Parameter.KEYWORD_ONLY:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(param.default, bool):
            p.add_argument(flag, action="store_true", help="keep the real special ids and vocab")
        else:
            p.add_argument(flag, type=int, default=param.default, help=f"default {param.default}")
    args = vars(p.parse_args(argv))
    args.pop("family")
    print(writer(args.pop("out_dir"), **args))
    return 0
