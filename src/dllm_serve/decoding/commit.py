"""Commit rules: which of a block's masked positions receive their proposal this step.

Every rule works on a batch of rows at once: confidences ``c`` ``[R, M]`` of each row's
still-masked positions of its active block (ascending position order, then padding), where
padding and anything else that must never be committed holds ``-inf``. Each returns a boolean
``[R, M]`` of the positions to commit. Ties are broken towards the lowest position,
deterministically (``torch.topk`` and an unstable sort promise no order among equal values).
The 1-D helpers (one row, ``[N]``) are the same rules for a single request.
"""

from __future__ import annotations

import torch


def topk_commit_rows(confidence: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """LLaDA's low-confidence remasking: commit each row's ``k[r]`` most confident positions.

    The rest stay masked ("remasked") and are predicted again next step with more context.
    A stable descending sort over ascending positions breaks ties by the lowest position; a
    position's rank is its index in that order (the inverse permutation, by a second sort).
    """
    order = torch.sort(confidence, dim=-1, descending=True, stable=True).indices
    rank = torch.argsort(order, dim=-1)
    return rank < k[:, None]


def argmax_onehot(confidence: torch.Tensor) -> torch.Tensor:
    """``[R, M]`` bool marking each row's most confident position (the first among ties)."""
    first = confidence.argmax(dim=-1, keepdim=True)
    return torch.zeros_like(confidence, dtype=torch.bool).scatter_(-1, first, True)


def threshold_commit_rows(confidence: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Fast-dLLM's parallel decoding: ``{argmax c} ∪ {i : c_i ≥ threshold}`` per row.

    Fast-dLLM (arXiv:2505.22618, Thm. 1) shows that when every committed marginal has
    confidence above ``1 − ε`` with ``(n + 1)ε ≤ 1``, greedy parallel decoding of those ``n``
    positions equals greedy sequential decoding, so confident positions can be committed
    together. The most confident position is always committed, even below the threshold,
    so every step makes progress and a block of ``b`` masks needs at most ``b`` forwards.
    """
    return (confidence >= threshold[:, None]) | argmax_onehot(confidence)
