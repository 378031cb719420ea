"""The batched commit rules of ``decoding/commit_rules.py`` for one
row: what the tests state their cases with (the engine only ever calls the batched ones)."""

from __future__ import annotations

import torch

from dllm_serve.decoding.commit_rules import (
    local_leap_commit_rows,
    near_anchor_rows,
    threshold_commit_rows,
    topk_commit_rows,
)


def topk_commit(confidence: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`topk_commit_rows` for one row ``[N]``."""
    return topk_commit_rows(confidence[None], torch.tensor([k]))[0]


def threshold_commit(confidence: torch.Tensor, threshold: float) -> torch.Tensor:
    """:func:`threshold_commit_rows` for one row ``[N]``."""
    limit = torch.tensor([threshold], dtype=confidence.dtype)
    return threshold_commit_rows(confidence[None], limit)[0]


def near_anchor(positions: torch.Tensor, anchors: torch.Tensor, radius: int) -> torch.Tensor:
    """:func:`near_anchor_rows` for one row of ascending canvas ``positions`` ``[N]``."""
    if positions.numel() == 0:
        return torch.zeros_like(anchors)
    offsets = positions - positions[0]
    span = int(offsets[-1]) + 1
    return near_anchor_rows(offsets[None], anchors[None], torch.tensor([radius]), span)[0]


def local_leap_commit(
    confidence: torch.Tensor,
    positions: torch.Tensor,
    anchor_threshold: float,
    neighbor_threshold: float,
    radius: int,
) -> torch.Tensor:
    """:func:`local_leap_commit_rows` for one row (``positions``: ascending canvas positions)."""
    if positions.numel() == 0:
        return torch.zeros_like(confidence, dtype=torch.bool)
    offsets = positions - positions[0]
    span = int(offsets[-1]) + 1

    def scalar(x: float) -> torch.Tensor:
        return torch.tensor([x], dtype=confidence.dtype)

    return local_leap_commit_rows(
        confidence[None], offsets[None], scalar(anchor_threshold), scalar(neighbor_threshold),
        torch.tensor([radius]), span,
    )[0]  # fmt: skip
