"""A deterministic generator of short chat tasks whose answers can be checked exactly.

Every example is a (question, answer) pair. The held-out split is decided by a hash of the
question, so training never sees a held-out question whatever the seed or the sample count.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

HELD_OUT_PERCENT = 10
LETTERS = "abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True, slots=True)
class Example:
    task: str
    question: str
    answer: str


def is_held_out(question: str) -> bool:
    digest = hashlib.sha256(question.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HELD_OUT_PERCENT


def _addition(rng: random.Random) -> Example:
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    return Example("addition", f"What is {a} + {b}?", f"{a} + {b} = {a + b}")


def _mixed_length_operand(rng: random.Random) -> int:
    """Half the time uniform in 0–999, else a uniformly drawn digit count (1–3) first."""
    if rng.random() < 0.5:
        return rng.randint(0, 999)
    digits = rng.randint(1, 3)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def _addition_mixed_lengths(rng: random.Random) -> Example:
    """Training-only addition with many short operands: a curriculum inside every batch.

    Uniform 0–999 operands (the held-out distribution) are 3-digit 90% of the time; a masked
    diffusion model learns the digit alignment far sooner when 1- and 2-digit sums are common.
    """
    a, b = _mixed_length_operand(rng), _mixed_length_operand(rng)
    return Example("addition", f"What is {a} + {b}?", f"{a} + {b} = {a + b}")


def _subtraction(rng: random.Random) -> Example:
    a, b = sorted((rng.randint(0, 999), rng.randint(0, 999)), reverse=True)
    return Example("subtraction", f"What is {a} - {b}?", f"{a} - {b} = {a - b}")


def _word(rng: random.Random, lo: int = 3, hi: int = 6) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(lo, hi)))


def _reverse(rng: random.Random) -> Example:
    w = _word(rng)
    return Example("reverse", f"Reverse the word {w}.", w[::-1])


def _sort(rng: random.Random) -> Example:
    w = _word(rng)
    return Example("sort", f"Sort the letters of {w}.", "".join(sorted(w)))


def _count(rng: random.Random) -> Example:
    w, c = _word(rng, 4, 8), rng.choice(LETTERS[:6])
    w = "".join(c if rng.random() < 0.3 else ch for ch in w)
    return Example("count", f"How many times does {c} appear in {w}?", str(w.count(c)))


def _lookup(rng: random.Random) -> Example:
    keys = rng.sample(LETTERS, 3)
    values = [rng.randint(0, 99) for _ in keys]
    pairs = ", ".join(f"{k}={v}" for k, v in zip(keys, values, strict=True))
    i = rng.randrange(3)
    return Example("lookup", f"Given {pairs}, what is {keys[i]}?", str(values[i]))


TASKS: dict[str, Callable[[random.Random], Example]] = {
    "addition": _addition,
    "subtraction": _subtraction,
    "reverse": _reverse,
    "sort": _sort,
    "count": _count,
    "lookup": _lookup,
}
# Addition is the headline task (its accuracy is what the model card reports first).
WEIGHTS = {"addition": 4, "subtraction": 1, "reverse": 1, "sort": 1, "count": 1, "lookup": 1}


def examples(
    seed: int,
    split: str = "train",
    tasks: tuple[str, ...] = tuple(TASKS),
    weights: dict[str, int] | None = None,
    addition_operands: str = "uniform",
) -> Iterator[Example]:
    """An endless stream of examples of ``split`` ("train" or "held_out"), reproducible.

    ``weights`` (default :data:`WEIGHTS`) gives each task's relative frequency.
    ``addition_operands``: ``"uniform"`` (0–999, the held-out distribution) or ``"mixed"``
    (:func:`_addition_mixed_lengths`, for training only).
    """
    if split not in ("train", "held_out"):
        raise ValueError("split must be 'train' or 'held_out'")
    if addition_operands not in ("uniform", "mixed"):
        raise ValueError("addition_operands must be 'uniform' or 'mixed'")
    if split == "held_out" and addition_operands != "uniform":
        raise ValueError("the held-out split is always drawn uniformly")
    generators = dict(TASKS)
    if addition_operands == "mixed":
        generators["addition"] = _addition_mixed_lengths
    rng = random.Random(seed)
    weights = weights or WEIGHTS
    names = [t for t in tasks for _ in range(weights[t])]
    while True:
        ex = generators[rng.choice(names)](rng)
        if is_held_out(ex.question) == (split == "held_out"):
            yield ex


def held_out_set(n: int, seed: int = 12345, task: str | None = None) -> list[Example]:
    tasks = (task,) if task else tuple(TASKS)
    stream = examples(seed, "held_out", tasks)
    return [next(stream) for _ in range(n)]
