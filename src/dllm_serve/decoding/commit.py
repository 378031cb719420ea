"""Commit rules: which of a block's masked positions receive their proposal this step.

Every rule takes the confidences ``c`` ``[N]`` of the ``N ≥ 1`` still-masked positions of the
active block (in ascending position order) and returns a boolean mask ``[N]`` of the positions
to commit. Ties are broken towards the lowest position, deterministically (``torch.topk`` and
``torch.sort`` without ``stable`` promise no order among equal values).
"""

from __future__ import annotations

import torch


def topk_commit(confidence: torch.Tensor, k: int) -> torch.Tensor:
    """LLaDA's low-confidence remasking: commit the ``k`` most confident positions.

    The rest stay masked ("remasked") and are predicted again next step with more context.
    A stable descending sort over ascending positions breaks ties by the lowest position.
    """
    chosen = torch.sort(confidence, descending=True, stable=True).indices[:k]
    commit = torch.zeros_like(confidence, dtype=torch.bool)
    commit[chosen] = True
    return commit


def threshold_commit(confidence: torch.Tensor, threshold: float) -> torch.Tensor:
    """Fast-dLLM's parallel decoding: ``{argmax c} ∪ {i : c_i ≥ threshold}``.

    Fast-dLLM (arXiv:2505.22618, Thm. 1) shows that when every committed marginal has
    confidence above ``1 − ε`` with ``(n + 1)ε ≤ 1``, greedy parallel decoding of those ``n``
    positions equals greedy sequential decoding, so confident positions can be committed
    together. The most confident position is always committed, even below the threshold,
    so every step makes progress and a block of ``b`` masks needs at most ``b`` forwards.
    ``argmax`` returns the first maximum, i.e. the lowest position among ties.
    """
    commit = confidence >= threshold
    commit[confidence.argmax()] = True
    return commit
