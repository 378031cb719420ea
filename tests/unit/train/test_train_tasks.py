"""The demo task generator: deterministic, checkable answers, disjoint held-out split."""

from __future__ import annotations

import itertools
import re

import pytest

from dllm_serve_train.tasks import (
    SHOWCASE,
    STRATA,
    TASKS,
    WEIGHTS,
    examples,
    held_out_additions,
    held_out_set,
    is_held_out,
    stratum,
    words,
)


def test_streams_are_reproducible_and_splits_disjoint() -> None:
    a = list(itertools.islice(examples(7, "train"), 200))
    b = list(itertools.islice(examples(7, "train"), 200))
    assert a == b
    held = held_out_set(200)
    assert all(is_held_out(e.question) for e in held)
    assert not any(is_held_out(e.question) for e in a)
    assert {e.task for e in a} == {t for t in TASKS if WEIGHTS[t]}


def test_answers_are_correct() -> None:
    for ex in itertools.islice(examples(3, "train"), 500):
        if ex.task in ("addition", "subtraction"):
            m = re.fullmatch(r"What is (\d+) ([+-]) (\d+)\?", ex.question)
            assert m
            x, op, y = int(m[1]), m[2], int(m[3])
            assert 0 <= x <= 999 and 0 <= y <= 999
            assert ex.answer == f"{x} {op} {y} = {x + y if op == '+' else x - y}"
        elif ex.task == "reverse":
            word = ex.question.removeprefix("Reverse the word ").removesuffix(".")
            assert ex.answer == word[::-1]
        elif ex.task == "sort":
            word = ex.question.removeprefix("Sort the letters of ").removesuffix(".")
            assert ex.answer == "".join(sorted(word))
        elif ex.task == "count":
            m = re.fullmatch(r"How many times does (\w) appear in (\w+)\?", ex.question)
            assert m and ex.answer == str(m[2].count(m[1]))
        else:
            m = re.fullmatch(r"Given (.*), what is (\w)\?", ex.question)
            assert m
            table = dict(pair.split("=") for pair in m[1].split(", "))
            assert ex.answer == table[m[2]]


def test_addition_operands_cover_three_digits() -> None:
    adds = held_out_set(300, task="addition")
    three_digit = [e for e in adds if all(len(n) == 3 for n in re.findall(r"\d+", e.question)[:2])]
    assert len(three_digit) > 200  # uniform over 0-999: ~81% are 3+3 digits


def test_mixed_length_additions_are_short_more_often_and_never_held_out() -> None:
    def operands(stream: list) -> list[int]:
        return [int(n) for e in stream for n in re.findall(r"\d+", e.question)]

    kw = {"tasks": ("addition",)}
    uniform = list(itertools.islice(examples(5, "train", **kw), 2000))
    mixed = list(itertools.islice(examples(5, "train", **kw, addition_operands="mixed"), 2000))
    assert mixed == list(
        itertools.islice(examples(5, "train", **kw, addition_operands="mixed"), 2000)
    )
    assert not any(is_held_out(e.question) for e in mixed)
    for e in mixed:
        x, y = (int(n) for n in re.findall(r"\d+", e.question))
        assert 0 <= x <= 999 and 0 <= y <= 999 and e.answer == f"{x} + {y} = {x + y}"
    # Uniform 0-999: ~1% one-digit operands; mixed: 1/2 * 1/3 of them have one digit.
    one_digit = {
        name: sum(n < 10 for n in operands(s)) / 4000
        for name, s in (("uniform", uniform), ("mixed", mixed))
    }
    assert one_digit["uniform"] < 0.03 and 0.12 < one_digit["mixed"] < 0.22


def test_held_out_split_is_always_uniform() -> None:
    with pytest.raises(ValueError, match="uniformly"):
        next(examples(0, "held_out", addition_operands="mixed"))
    with pytest.raises(ValueError, match="addition_operands must be"):
        next(examples(0, "train", addition_operands="short"))


def test_curriculum_starts_short_and_ends_on_the_held_out_distribution() -> None:
    stream = examples(
        2, "train", tasks=("addition",), addition_operands="curriculum", ramp_examples=1000
    )
    first, _, after = (list(itertools.islice(stream, n)) for n in (500, 500, 1000))
    one_digit = [
        sum(int(n) < 10 for e in part for n in re.findall(r"\d+", e.question)) / (2 * len(part))
        for part in (first, after)
    ]
    assert one_digit[0] > 0.15  # mostly drawn by digit count at the start
    assert one_digit[1] < 0.03  # uniform 0-999 after the ramp (~1% one-digit operands)
    assert not any(is_held_out(e.question) for e in first + after)
    with pytest.raises(ValueError, match="ramp_examples"):
        next(examples(0, "train", addition_operands="curriculum"))


def test_stratified_additions_cover_every_digit_count_pair_evenly() -> None:
    weights = dict.fromkeys(TASKS, 0) | {"addition": 1}
    stream = examples(11, "train", weights=weights, addition_operands="stratified")
    exs = list(itertools.islice(stream, 3600))
    pairs = {}
    for ex in exs:
        a, b = re.fullmatch(r"What is (\d+) \+ (\d+)\?", ex.question).groups()
        pairs[(len(a), len(b))] = pairs.get((len(a), len(b)), 0) + 1
        assert ex.answer == f"{a} + {b} = {int(a) + int(b)}"
    assert set(pairs) == {(x, y) for x in (1, 2, 3) for y in (1, 2, 3)}
    assert min(pairs.values()) > 300  # 400 expected each


def test_held_out_strata_are_held_out_and_of_their_stratum() -> None:
    for name in STRATA:
        exs = held_out_additions(name, 100)
        assert exs and all(is_held_out(e.question) and stratum(e) == name for e in exs)
        assert len({e.question for e in exs}) == len(exs)
    one_digit = held_out_additions("1+1", 100)
    assert 5 <= len(one_digit) <= 20  # ~10% of the 100 one-digit pairs
    assert "What is 2 + 2?" in {e.question for e in one_digit}


def test_the_questions_the_docs_show_are_never_trained_on() -> None:
    assert all(is_held_out(q) for q in SHOWCASE)
    stream = examples(
        0, "train", weights=dict(WEIGHTS, reverse_word=5), addition_operands="stratified"
    )
    seen = {e.question for e in itertools.islice(stream, 20000)}
    assert not seen & SHOWCASE


def test_word_tasks_use_real_words_held_out_by_question() -> None:
    assert len(words()) > 500 and all(w.isalpha() and w.islower() for w in words())
    held = held_out_set(1000, task="reverse_word")
    assert {"Reverse the word hello.", "Reverse the word cat."} <= {e.question for e in held}
    assert all(e.answer == e.question.split()[-1].rstrip(".")[::-1] for e in held)
    assert 40 < len(held) < 150  # a tenth of the list, each word once
    weights = dict.fromkeys(TASKS, 0) | {"reverse_word": 1, "sort_word": 1}
    train = list(itertools.islice(examples(2, "train", weights=weights), 500))
    assert not {e.question for e in train} & {e.question for e in held}
    for ex in train:
        word = ex.question.split()[-1].rstrip(".")
        assert word in words()
        assert ex.answer == (word[::-1] if ex.task == "reverse_word" else "".join(sorted(word)))
