"""A deterministic generator of short chat tasks whose answers can be checked exactly.

Every example is a (question, answer) pair. The held-out split is decided by a hash of the
question, so training never sees a held-out question whatever the seed or the sample count.
"""

from __future__ import annotations

import functools
import hashlib
import random
from collections.abc import Callable, Iterator
from pathlib import Path

from dllm_serve_train import phrasings
from dllm_serve_train.phrasings import Example

HELD_OUT_PERCENT = 10
LETTERS = "abcdefghijklmnopqrstuvwxyz"
# Questions the README and docs show, always held out so that what a newcomer types first is
# never a question the demos were trained on.
SHOWCASE = frozenset(
    {
        "What is 2 + 2?",
        "What is 15 + 27?",
        "What is 123 + 456?",
        "What is 250 + 19?",
        "What is 358 + 677?",
        "Reverse the word hello.",
        "Reverse the word cat.",
    }
)
# Addition strata by operand digit counts: what the model cards report separately. Operands
# uniform in 0-999 are three-digit 90% of the time, so a uniform test says little about 2 + 2.
STRATA = ("1+1", "2+2", "mixed", "3+3")


def is_held_out(question: str) -> bool:
    if question in SHOWCASE:
        return True
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


def _digits_operand(rng: random.Random, digits: int) -> int:
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def _addition_stratified(rng: random.Random) -> Example:
    """Each operand's digit count (1-3) drawn uniformly first: the nine length pairs equally
    often, so 2 + 2 is as common as 123 + 456 (training and held-out alike)."""
    a = _digits_operand(rng, rng.randint(1, 3))
    b = _digits_operand(rng, rng.randint(1, 3))
    return Example("addition", f"What is {a} + {b}?", f"{a} + {b} = {a + b}")


def stratum(ex: Example) -> str:
    """An addition's stratum: "1+1", "2+2", "3+3" or "mixed" (different digit counts)."""
    a, b = ex.question.removeprefix("What is ").removesuffix("?").split(" + ")
    return f"{len(a)}+{len(b)}" if len(a) == len(b) else "mixed"


def held_out_additions(stratum_name: str, n: int, seed: int = 12345) -> list[Example]:
    """Up to ``n`` distinct held-out additions of one stratum (1+1 has only ~10: every
    held-out one-digit pair, "What is 2 + 2?" among them)."""
    if stratum_name == "1+1":
        pairs = [(a, b) for a in range(10) for b in range(10)]
        exs = [Example("addition", f"What is {a} + {b}?", f"{a} + {b} = {a + b}") for a, b in pairs]
        return [e for e in exs if is_held_out(e.question)][:n]
    rng, seen, out = random.Random(seed), set(), []
    while len(out) < n:
        if stratum_name == "mixed":
            da, db = rng.sample((1, 2, 3), 2)
        else:
            da = db = int(stratum_name[0])
        a, b = _digits_operand(rng, da), _digits_operand(rng, db)
        q = f"What is {a} + {b}?"
        if q not in seen and is_held_out(q):
            seen.add(q)
            out.append(Example("addition", q, f"{a} + {b} = {a + b}"))
    return out


@functools.cache
def words() -> tuple[str, ...]:
    """Common English words of 3-7 letters (``words.txt``), for the reversal and sorting
    tasks: people try ``hello`` before ``xqzt``."""
    text = (Path(__file__).with_name("words.txt")).read_text()
    return tuple(w for w in text.split() if w)


@functools.cache
def trained_words() -> tuple[str, ...]:
    """The words of :func:`words` whose reversal is trained (not held out)."""
    return tuple(w for w in words() if not is_held_out(f"Reverse the word {w}."))


def _subtraction(rng: random.Random) -> Example:
    a, b = sorted((rng.randint(0, 999), rng.randint(0, 999)), reverse=True)
    return Example("subtraction", f"What is {a} - {b}?", f"{a} - {b} = {a - b}")


def _word(rng: random.Random, lo: int = 3, hi: int = 6) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(lo, hi)))


def _reverse(rng: random.Random) -> Example:
    w = _word(rng)
    return Example("reverse", f"Reverse the word {w}.", w[::-1])


def _reverse_long(rng: random.Random) -> Example:
    """Random letter strings of 7-10 letters: longer than any word of :func:`words`, so that
    a longer word a person types is not beyond every reversal trained."""
    w = _word(rng, 7, 10)
    return Example("reverse_long", f"Reverse the word {w}.", w[::-1])


def _off_topic(rng: random.Random) -> Example:
    return phrasings.off_topic(rng, "train", words())


def _reverse_word(rng: random.Random) -> Example:
    w = rng.choice(words())
    return Example("reverse_word", f"Reverse the word {w}.", w[::-1])


def _sort_word(rng: random.Random) -> Example:
    w = rng.choice(words())
    return Example("sort_word", f"Sort the letters of {w}.", "".join(sorted(w)))


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
    "reverse_word": _reverse_word,
    "reverse_long": _reverse_long,
    "off_topic": _off_topic,
    "sort": _sort,
    "sort_word": _sort_word,
    "count": _count,
    "lookup": _lookup,
}
# Addition is the headline task (its accuracy is what the model card reports first).
WEIGHTS = {
    "addition": 4,
    "subtraction": 1,
    "reverse": 1,
    "reverse_word": 0,
    "reverse_long": 0,
    "off_topic": 0,
    "sort": 1,
    "sort_word": 0,
    "count": 1,
    "lookup": 1,
}


def examples(
    seed: int,
    split: str = "train",
    tasks: tuple[str, ...] = tuple(TASKS),
    weights: dict[str, int] | None = None,
    addition_operands: str = "uniform",
    ramp_examples: int = 0,
    phrasing: float = 0.0,
    context: float = 0.0,
    composed: float = 0.0,
    unfamiliar_verbs: float = 0.0,
) -> Iterator[Example]:
    """An endless stream of examples of ``split`` ("train" or "held_out"), reproducible.

    ``weights`` (default :data:`WEIGHTS`) gives each task's relative frequency.
    ``addition_operands`` (training only besides ``"uniform"``): ``"uniform"`` (0–999, the
    held-out distribution); ``"mixed"``, half of the additions with short operands
    (:func:`_addition_short_operands`); ``"curriculum"``, short operands first, their share
    falling linearly to none over the first ``ramp_examples`` examples of the stream.
    ``phrasing``: the share of additions and reversals asked in a random template of the
    split (``phrasings.py``; the canonical question is one of the training templates) with
    surface noise; ``context``: the share of examples that come after a system prompt and/or
    earlier turns (other examples of the stream, with their answers); ``composed``: the share
    of phrased training reversals asked in a composed phrasing (``composed.py``);
    ``unfamiliar_verbs``: the share of those whose verb is another training word.
    """
    if split not in ("train", "held_out"):
        raise ValueError("split must be 'train' or 'held_out'")
    if addition_operands not in ("uniform", "mixed", "curriculum", "stratified"):
        raise ValueError(
            "addition_operands must be 'uniform', 'mixed', 'curriculum' or 'stratified'"
        )
    if split == "held_out" and addition_operands not in ("uniform", "stratified"):
        raise ValueError("the held-out split is drawn uniformly or stratified")
    if addition_operands == "curriculum" and ramp_examples <= 0:
        raise ValueError("the curriculum needs ramp_examples > 0")
    shares = (phrasing, context, composed, unfamiliar_verbs)
    if not all(0.0 <= share <= 1.0 for share in shares):
        raise ValueError(
            "phrasing, context, composed and unfamiliar_verbs are shares between 0 and 1"
        )
    verbs = trained_words() if unfamiliar_verbs else ()
    rng = random.Random(seed)
    weights = weights or WEIGHTS
    names = [t for t in tasks for _ in range(weights[t])]
    drawn = 0

    def draw() -> Example:
        while True:
            task = rng.choice(names)
            if task == "off_topic":  # split by its own rule (off_topic.off_topic_held_out)
                return phrasings.off_topic(rng, split, words())
            if task == "addition" and addition_operands == "stratified":
                ex = _addition_stratified(rng)
            elif task == "addition" and addition_operands != "uniform":
                p_uniform = 0.5 if addition_operands == "mixed" else min(1.0, drawn / ramp_examples)
                ex = _addition_short_operands(rng, p_uniform)
            else:
                ex = TASKS[task](rng)
            if is_held_out(ex.question) != (split == "held_out"):
                continue
            if phrasing and task in phrasings.PHRASED and rng.random() < phrasing:
                ex = phrasings.rephrase(ex, rng, split, composed, unfamiliar_verbs, verbs)
            return ex

    while True:
        ex = draw()
        if context and rng.random() < context:
            ex = phrasings.with_context(ex, rng, split, draw)
        drawn += 1
        yield ex


def held_out_set(n: int, seed: int = 12345, task: str | None = None) -> list[Example]:
    """``n`` held-out examples (all tasks, or one). A word task has only about a tenth of
    :func:`words` held out: its set is those distinct questions, fewer than ``n`` if need be."""
    tasks = (task,) if task else tuple(TASKS)
    if task in ("reverse_word", "sort_word"):
        exs: list[Example] = []
        make = _reverse_word if task == "reverse_word" else _sort_word
        for w in words():
            ex = make(_Fixed(w))
            if is_held_out(ex.question):
                exs.append(ex)
        return exs[:n]
    stream = examples(seed, "held_out", tasks, weights={task: 1} if task else None)
    return [next(stream) for _ in range(n)]


PHRASING_SETS = ("addition", "reverse_word", "off_topic")


def held_out_phrasings(task: str, n: int, seed: int = 2024) -> list[Example]:
    """``n`` distinct held-out questions asked in held-out phrasings: no training example
    has their template, nor (additions, reversals) their content.

    ``addition``: each operand's digit count (1-3) drawn first, operands held out as in
    :func:`held_out_additions`. ``reverse_word``: the held-out English words. ``off_topic``:
    the held-out off-topic prompts (``off_topic.off_topic_question``), a third or so of them
    from families never trained on.
    """
    rng, seen, out = random.Random(f"{task}:{seed}"), set(), []
    held = [w for w in words() if is_held_out(f"Reverse the word {w}.")]
    while len(out) < n:
        if task == "addition":
            a = _digits_operand(rng, rng.randint(1, 3))
            b = _digits_operand(rng, rng.randint(1, 3))
            ex = Example("addition", f"What is {a} + {b}?", f"{a} + {b} = {a + b}")
            if not is_held_out(ex.question):
                continue
            ex = phrasings.rephrase(ex, rng, "held_out")
        elif task == "reverse_word":
            w = rng.choice(held)
            ex = phrasings.rephrase(_reverse_word(_Fixed(w)), rng, "held_out")
        elif task == "off_topic":
            ex = phrasings.off_topic(rng, "held_out", words())
        else:
            raise ValueError(f"no held-out phrasings of {task!r}")
        if ex.question not in seen:
            seen.add(ex.question)
            out.append(ex)
    return out


def held_out_system_prompts() -> list[str]:
    """System prompts never trained on (``phrasings.SYSTEM_PROMPTS``)."""
    return [t.text for t in phrasings.SYSTEM_PROMPTS if t.split == "held_out"]


class _Fixed(random.Random):
    """A Random whose ``choice`` returns one given item (to enumerate the word tasks)."""

    def __init__(self, item: str) -> None:
        super().__init__(0)
        self.item = item

    def choice(self, seq):  # type: ignore[override]
        return self.item
