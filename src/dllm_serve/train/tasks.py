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


def _operand(rng: random.Random, p_uniform: float) -> int:
    """Uniform in 0–999 with probability ``p_uniform``, else a uniformly drawn digit count
    (1–3) first, so that short operands are common."""
    if rng.random() < p_uniform:
        return rng.randint(0, 999)
    digits = rng.randint(1, 3)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def _addition_short_operands(rng: random.Random, p_uniform: float) -> Example:
    """Training-only addition with many short operands.

    Uniform 0–999 operands (the held-out distribution) are 3-digit 90% of the time, and then
    only the leading sum digit is correlated with any single operand digit: a units or tens
    digit depends on two digits at once (mod 10) and gives gradient descent nothing to start
    from. In 1- and 2-digit sums the low places carry magnitude, so the aligned digits can be
    found from them first (docs/training.md has what this reached for the LLaDA demo).
    """
    a, b = _operand(rng, p_uniform), _operand(rng, p_uniform)
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
    ramp_examples: int = 0,
) -> Iterator[Example]:
    """An endless stream of examples of ``split`` ("train" or "held_out"), reproducible.

    ``weights`` (default :data:`WEIGHTS`) gives each task's relative frequency.
    ``addition_operands`` (training only besides ``"uniform"``): ``"uniform"`` (0–999, the
    held-out distribution); ``"mixed"``, half of the additions with short operands
    (:func:`_addition_short_operands`); ``"curriculum"``, short operands first, their share
    falling linearly to none over the first ``ramp_examples`` examples of the stream.
    """
    if split not in ("train", "held_out"):
        raise ValueError("split must be 'train' or 'held_out'")
    if addition_operands not in ("uniform", "mixed", "curriculum"):
        raise ValueError("addition_operands must be 'uniform', 'mixed' or 'curriculum'")
    if split == "held_out" and addition_operands != "uniform":
        raise ValueError("the held-out split is always drawn uniformly")
    if addition_operands == "curriculum" and ramp_examples <= 0:
        raise ValueError("the curriculum needs ramp_examples > 0")
    rng = random.Random(seed)
    weights = weights or WEIGHTS
    names = [t for t in tasks for _ in range(weights[t])]
    drawn = 0
    while True:
        task = rng.choice(names)
        if task == "addition" and addition_operands != "uniform":
            p_uniform = 0.5 if addition_operands == "mixed" else min(1.0, drawn / ramp_examples)
            ex = _addition_short_operands(rng, p_uniform)
        else:
            ex = TASKS[task](rng)
        if is_held_out(ex.question) == (split == "held_out"):
            drawn += 1
            yield ex


def held_out_set(n: int, seed: int = 12345, task: str | None = None) -> list[Example]:
    tasks = (task,) if task else tuple(TASKS)
    stream = examples(seed, "held_out", tasks)
    return [next(stream) for _ in range(n)]
