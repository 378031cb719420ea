"""Host-side step logic shared by the block decoders that keep a :class:`DenoiseState` canvas
(``block_diffusion.py``, ``fast_dllm.py``, ``causal_diffusion.py``): writing a denoising row's
commits, ending the request, and the top-k schedule of a newly started block."""

from __future__ import annotations

from collections.abc import Sequence

from dllm_serve.decoding.forward_spec import StepResult
from dllm_serve.decoding.schedules import block_schedule
from dllm_serve.decoding.state import DenoiseState

__all__ = ["commit_masked", "finish_or_continue", "schedule_block"]


def commit_masked(state: DenoiseState, row: Sequence[int]) -> int:
    """Write a denoising row's tokens at the masked positions it committed (``mask_id`` where
    it committed nothing), keep the others masked and count the step. Returns how many
    positions were committed."""
    still: list[int] = []
    for pos, token in zip(state.masked, row, strict=False):
        if token == state.mask_id:
            still.append(pos)
        else:
            state.tokens[pos] = token
    committed = len(state.masked) - len(still)
    state.masked = still
    state.committed += committed
    state.step += 1
    return committed


def finish_or_continue(state: DenoiseState, committed: int) -> StepResult:
    """Extend the final answer after a step's commits; the request finishes once it holds a
    stop id or reaches the answer budget (``max_tokens``)."""
    new = state.advance_final()
    if state.stop_at is not None or state.final_len == state.params.gen_length:
        state.finished = True
        state.finish_reason = "stop" if state.stop_at is not None else "length"
        return StepResult(committed, True, state.finish_reason, new_tokens=new)
    return StepResult(committed, False, new_tokens=new)


def schedule_block(state: DenoiseState, steps: int) -> None:
    """The schedule of the masks in ``state.masked``: top-k spreads them over
    ``min(steps, masks)`` steps (at least one; no step that commits nothing), the
    data-dependent rules have none (``[0]``)."""
    if state.params.mode != "topk":
        state.schedule = [0]
        return
    steps = max(1, min(steps, len(state.masked)))
    state.schedule = block_schedule(state.params.block_schedule, len(state.masked), steps)
