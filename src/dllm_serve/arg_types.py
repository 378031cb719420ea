"""argparse types shared by the command lines (the server, make-tiny, the benchmark scripts):
a bad value is argparse's one-line error, never a traceback from deep inside a run."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path


def at_least(minimum: int) -> Callable[[str], int]:
    """An integer >= ``minimum`` (sizes and counts >= 1; seeds and 0-means-off >= 0)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def port(text: str) -> int:
    """A TCP port, 0-65535 (0: any free port). Checked here, not by the socket bind after the
    model has loaded (--port 99999 would fail with a traceback minutes into start-up)."""
    value = at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be 0-65535, got {value}")
    return value


def finite_float(text: str) -> float:
    """A float that is a real number (``nan`` and ``inf`` parse as floats, and then pass
    every ``> 0`` check while meaning nothing as seconds or GiB)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def new_or_empty_dir(text: str) -> Path:
    """A directory to write a checkpoint into: absent or empty. One written over another
    checkpoint would keep the other's stale files (an I-DLM chat template under a LLaDA
    checkpoint; ``--init X --out X`` would replace X's weights)."""
    path = Path(text)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise argparse.ArgumentTypeError(
            f"{text} exists and is not an empty directory: write to a new one"
        )
    return path
