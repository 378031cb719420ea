"""One batch, each row under its own commit rule: top-k, threshold or LocalLeap.

A batch may mix requests of every rule. Each rule runs once over the whole batch (only when
some row uses it) and ``torch.where`` picks every row's own result, so a row commits exactly
what it would commit alone; the per-row parameters travel in one host→device copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dllm_serve.decoding.commit import argmax_onehot, threshold_commit_rows, topk_commit_rows
from dllm_serve.decoding.host_values import to_device
from dllm_serve.decoding.local_leap import local_leap_commit_rows
from dllm_serve.decoding.state import DenoiseState


def commit_by_row_rule(
    states: Sequence[DenoiseState],
    score: torch.Tensor,
    k: torch.Tensor,
    device: torch.device,
) -> torch.Tensor:
    """Which proposals each row commits, under each row's own rule (``[R, M]`` bool).

    ``score`` ``[R, M]``: confidences of each row's masked positions of its active block
    (``-inf`` on padding); ``k`` ``[R]``: each top-k row's count for this step.
    """
    modes = [s.params.mode for s in states]
    commit = None
    if "topk" in modes:
        # One commit per row (steps == block length, the usual setting): each row's first
        # most confident position is what the stable sort ranks first, at a third of the cost.
        one_each = all(s.schedule[s.step] == 1 for s in states if s.params.mode == "topk")
        commit = argmax_onehot(score) if one_each else topk_commit_rows(score, k)
    if modes.count("topk") == len(modes):
        assert commit is not None
        return commit
    params = [s.params for s in states]
    floats = to_device(
        [p.confidence_threshold or p.local_leap_anchor_threshold for p in params]
        + [p.local_leap_neighbor_threshold for p in params],
        device,
        score.dtype,
    )
    kappa, tau = floats[: len(params)], floats[len(params) :]
    rule = threshold_commit_rows(score, kappa) if "threshold" in modes else None
    if "local_leap" in modes:
        # The widest active block: a block model's is its trained block, whatever its params'
        # canvas (found by QA: max_tokens below the block put offsets past the span, a 500).
        span = max(hi - lo for lo, hi in (s.active_block for s in states))
        offsets, radius = _offsets(states, score.shape[1], device)
        leap = local_leap_commit_rows(score, offsets, kappa, tau, radius, span)
        is_leap = to_device([m == "local_leap" for m in modes], device)
        rule = leap if rule is None else torch.where(is_leap[:, None], leap, rule)
    assert rule is not None
    if commit is None:
        return rule
    is_topk = to_device([m == "topk" for m in modes], device)
    return torch.where(is_topk[:, None], commit, rule)


def _offsets(
    states: Sequence[DenoiseState], width: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block offsets ``[R, M]`` of each row's masked positions (padding repeats the last)
    and each row's LocalLeap radius ``[R]``."""
    flat: list[int] = []
    for s in states:
        lo, _ = s.active_block
        offs = [p - lo for p in s.masked] or [0]
        flat.extend(offs + [offs[-1]] * (width - len(offs)))
    flat.extend(s.params.local_leap_radius for s in states)
    packed = to_device(flat, device, torch.long)
    rows = len(states)
    return packed[: rows * width].view(rows, width), packed[rows * width :]
