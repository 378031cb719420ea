"""How many masked tokens to commit at each denoising step of a block.

A schedule turns ``num_masked`` (the masks of a block when it starts) and ``steps`` (the steps
the block gets) into a list of ``steps`` non-negative counts summing to ``num_masked``. Only
fixed-step (top-k) decoding uses a schedule; the threshold and LocalLeap modes commit a
data-dependent number of tokens per step.

Every schedule here satisfies (property-tested over many ``(n, s)``):

- ``len == steps``, ``sum == num_masked``, every count ``>= 0``;
- when ``steps <= num_masked`` no step commits zero tokens (a zero step is a wasted forward);
  when ``steps > num_masked`` every step commits at most one (the fewest empty steps);
- ``uniform``: counts differ by at most one, remainder first (LLaDA);
- ``cosine``: non-decreasing (few commits early, many late);
- ``front_loaded``: non-increasing (many early, few late), the mirror image of ``cosine``.
"""

from __future__ import annotations

import math
from collections.abc import Callable


def _check(num_masked: int, steps: int) -> None:
    if steps < 1:
        raise ValueError("steps must be >= 1")
    if num_masked < 0:
        raise ValueError("num_masked must be >= 0")


def uniform_schedule(num_masked: int, steps: int) -> list[int]:
    """LLaDA's ``get_num_transfer_tokens``: an equal share per step, remainder first.

    LLaDA's forward process masks each token independently with probability ``t`` and the
    sampler walks ``t`` from 1 to 0 in equal decrements, so the expected number of tokens
    unmasked per step is the same at every step: ``num_masked / steps``. Integer counts are
    ``base = num_masked // steps`` everywhere plus one extra token on each of the first
    ``num_masked % steps`` steps. When ``steps > num_masked`` the trailing steps commit
    nothing (they still cost a forward pass in the reference sampler).
    """
    _check(num_masked, steps)
    base, remainder = divmod(num_masked, steps)
    return [base + 1 if i < remainder else base for i in range(steps)]


def cosine_schedule(num_masked: int, steps: int) -> list[int]:
    """Few commits early, many late: MaskGIT's cosine masking curve.

    MaskGIT keeps a fraction ``γ(r) = cos(π r / 2)`` of the tokens masked at time
    ``r = i / steps``, so the committed fraction is ``F(r) = 1 − cos(π r / 2)``: flat at the
    start (when the model sees least context and its predictions are least reliable) and
    steep at the end. Counts come from rounding the cumulative target ``C_i = n·F(i/s)``,
    then repaired by :func:`_from_cumulative` (at least one token per step when there are at
    least as many tokens as steps, at most one otherwise).
    """
    _check(num_masked, steps)
    cumulative = [num_masked * (1.0 - math.cos(math.pi * i / (2 * steps))) for i in range(steps)]
    return sorted(_from_cumulative(cumulative, num_masked))


def front_loaded_schedule(num_masked: int, steps: int) -> list[int]:
    """Many commits early, few late: the mirror image of :func:`cosine_schedule`.

    The committed fraction is ``F(r) = sin(π r / 2) = 1 − F_cos(1 − r)``; we return the cosine
    counts reversed, which is that curve with the same rounding, so the two schedules are
    exact mirrors of each other (tested).
    """
    return cosine_schedule(num_masked, steps)[::-1]


def _from_cumulative(cumulative: list[float], n: int) -> list[int]:
    """Per-step counts from real cumulative targets ``C_0..C_{s-1}`` (``C_s = n`` implied).

    Naive rounding of a curve gives zero-commit steps (n = 32, s = 32 under cosine has many),
    each a wasted forward. Repair, left to right, with ``C_0 = 0`` before the first step:
    ``C_i ← max(C_i, C_{i−1} + 1)`` (at least one token per step) and
    ``C_i ≤ n − (s − i)`` (leave at least one token for each remaining step), when ``n ≥ s``.
    With fewer masks than steps some steps must be empty; then each step commits at most one
    token, so no more than ``s − n`` forwards are spent on empty steps. The caller sorts
    the counts, because rounding a convex curve can still yield e.g. ``[…, 1, 0, 1, …]``;
    sorting keeps the multiset (sum, minimum) and makes the shape monotone.
    """
    steps = len(cumulative)
    previous = 0
    counts = []
    for i in range(1, steps + 1):
        # Round half up (not Python's half-to-even) so the result is a plain function of C_i.
        target = n if i == steps else math.floor(cumulative[i] + 0.5)
        if n >= steps:
            target = min(max(target, previous + 1), n - (steps - i))
        else:
            # Mirror rule with fewer masks than steps: at most one token per step, so exactly
            # s − n steps are empty (the fewest possible) and the block still finishes.
            target = min(max(target, previous, n - (steps - i)), previous + 1)
        counts.append(target - previous)
        previous = target
    return counts


SCHEDULES: dict[str, Callable[[int, int], list[int]]] = {
    "uniform": uniform_schedule,
    "cosine": cosine_schedule,
    "front_loaded": front_loaded_schedule,
}


def block_schedule(name: str, num_masked: int, steps: int) -> list[int]:
    """Dispatch to the schedule called ``name`` (see ``DecodingParams.block_schedule``)."""
    schedule = SCHEDULES.get(name)
    if schedule is None:
        raise ValueError(f"unknown block_schedule {name!r} (available: {sorted(SCHEDULES)})")
    return schedule(num_masked, steps)
