"""uniform_schedule (LLaDA get_num_transfer_tokens) and the block_schedule dispatcher."""

from __future__ import annotations

import itertools

import pytest

from dllm_serve.decoding.schedules import block_schedule, uniform_schedule

CASES = [(32, 4), (32, 32), (10, 3), (7, 7), (5, 8), (0, 4), (1, 1), (100, 7), (3, 10)]


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


def test_uniform_schedule_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        uniform_schedule(4, 0)
    with pytest.raises(ValueError):
        uniform_schedule(-1, 4)


def test_block_schedule_dispatch() -> None:
    assert block_schedule("uniform", 10, 4) == uniform_schedule(10, 4)
    for name in ("cosine", "front_loaded", "nope"):
        with pytest.raises(ValueError, match="not available yet"):
            block_schedule(name, 10, 4)
