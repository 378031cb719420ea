"""How many masked tokens to commit at each denoising step of a block.

A schedule turns ``num_masked`` (the masks of a block when it starts) and ``steps`` (the steps
the block gets) into a list of ``steps`` non-negative counts summing to ``num_masked``.
"""

from __future__ import annotations


def uniform_schedule(num_masked: int, steps: int) -> list[int]:
    """LLaDA's ``get_num_transfer_tokens``: an equal share per step, remainder first.

    LLaDA's forward process masks each token independently with probability ``t`` and the
    sampler walks ``t`` from 1 to 0 in equal decrements, so the expected number of tokens
    unmasked per step is the same at every step: ``num_masked / steps``. Integer counts are
    ``base = num_masked // steps`` everywhere plus one extra token on each of the first
    ``num_masked % steps`` steps. When ``steps > num_masked`` the trailing steps commit
    nothing (they still cost a forward pass in the reference sampler).
    """
    if steps < 1:
        raise ValueError("steps must be >= 1")
    if num_masked < 0:
        raise ValueError("num_masked must be >= 0")
    base, remainder = divmod(num_masked, steps)
    return [base + 1 if i < remainder else base for i in range(steps)]


_SCHEDULES = {"uniform": uniform_schedule}


def block_schedule(name: str, num_masked: int, steps: int) -> list[int]:
    """Dispatch to the schedule called ``name`` (see ``DecodingParams.block_schedule``)."""
    schedule = _SCHEDULES.get(name)
    if schedule is None:
        raise ValueError(
            f"block_schedule {name!r} is not available yet (available: {sorted(_SCHEDULES)})"
        )
    return schedule(num_masked, steps)
