"""Block schedules (algorithms.md §1.3, §4.1): uniform, cosine, front_loaded and the dispatcher."""

from __future__ import annotations

import itertools

import pytest

from dllm_serve.decoding.commit_rules import (
    SCHEDULES,
    block_schedule,
    cosine_schedule,
    front_loaded_schedule,
    uniform_schedule,
)

CASES = [(32, 4), (32, 32), (10, 3), (7, 7), (5, 8), (0, 4), (1, 1), (100, 7), (3, 10)]
# Every (n, s) with n masks in 0..96 and s steps in 1..64: the property sweep.
GRID = [(n, s) for n in range(97) for s in range(1, 65)]


@pytest.mark.parametrize(("n", "steps"), CASES)
def test_uniform_schedule_invariants(n: int, steps: int) -> None:
    sched = uniform_schedule(n, steps)
    assert len(sched) == steps
    assert sum(sched) == n
    assert max(sched) - min(sched) <= 1
    assert all(a >= b for a, b in itertools.pairwise(sched))
    base, remainder = divmod(n, steps)
    # the remainder goes to the FIRST steps
    assert sched == [base + 1] * remainder + [base] * (steps - remainder)


def test_uniform_schedule_examples() -> None:
    assert uniform_schedule(32, 4) == [8, 8, 8, 8]
    assert uniform_schedule(10, 4) == [3, 3, 2, 2]
    assert uniform_schedule(3, 5) == [1, 1, 1, 0, 0]  # steps > n: trailing zero-commit steps


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_schedule_properties_over_many_sizes(name: str) -> None:
    schedule = SCHEDULES[name]
    for n, s in GRID:
        k = schedule(n, s)
        assert len(k) == s, (name, n, s)
        assert sum(k) == n, (name, n, s, k)
        assert min(k) >= 0, (name, n, s, k)
        if s <= n:
            # §4.1 repair: no wasted forward while masks remain
            assert min(k) >= 1, (name, n, s, k)
        else:
            # with fewer masks than steps, each step commits at most one
            assert max(k) <= 1 and k.count(1) == n, (name, n, s, k)
        pairs = list(itertools.pairwise(k))
        if name == "cosine":
            assert all(a <= b for a, b in pairs), (n, s, k)
        elif name == "front_loaded":
            assert all(a >= b for a, b in pairs), (n, s, k)
        else:
            assert max(k) - min(k) <= 1


def test_front_loaded_mirrors_cosine() -> None:
    for n, s in GRID:
        assert front_loaded_schedule(n, s) == cosine_schedule(n, s)[::-1]


def test_cosine_follows_its_curve() -> None:
    # C_i = round(n·(1 − cos(πi/2s))) where the repair rules are inactive (n large vs s).
    assert cosine_schedule(32, 4) == [2, 7, 11, 12]
    assert cosine_schedule(32, 8) == [1, 1, 3, 4, 5, 6, 6, 6]
    assert cosine_schedule(1000, 4) == [76, 217, 324, 383]
    assert front_loaded_schedule(32, 4) == [12, 11, 7, 2]
    # shapes really differ from uniform: cosine back-loads, front_loaded front-loads
    for n, s in [(32, 4), (64, 8), (128, 16)]:
        cos, front = cosine_schedule(n, s), front_loaded_schedule(n, s)
        assert cos[0] < n // s < cos[-1]
        assert front[0] > n // s > front[-1]


def test_zero_commit_repair_cases() -> None:
    # naive rounding of the cosine curve gives zero steps here (algorithms.md §4.1 pitfall)
    assert cosine_schedule(32, 32) == [1] * 32
    assert 0 not in cosine_schedule(32, 8)
    assert cosine_schedule(5, 8) == [0, 0, 0, 1, 1, 1, 1, 1]  # s > n: zeros first (non-decreasing)
    assert front_loaded_schedule(5, 8) == [1, 1, 1, 1, 1, 0, 0, 0]
    assert cosine_schedule(0, 3) == [0, 0, 0]


@pytest.mark.parametrize("schedule", [uniform_schedule, cosine_schedule, front_loaded_schedule])
def test_schedules_reject_bad_input(schedule) -> None:
    with pytest.raises(ValueError):
        schedule(4, 0)
    with pytest.raises(ValueError):
        schedule(-1, 4)


def test_block_schedule_dispatch() -> None:
    assert block_schedule("uniform", 10, 4) == uniform_schedule(10, 4)
    assert block_schedule("cosine", 10, 4) == cosine_schedule(10, 4)
    assert block_schedule("front_loaded", 10, 4) == front_loaded_schedule(10, 4)
    with pytest.raises(ValueError, match="unknown block_schedule"):
        block_schedule("nope", 10, 4)
