"""LocalLeap (arXiv:2510.07081): local determinism propagation around confident anchors.

The rule follows the authors' ``get_transfer_index``, not a schedule-bound adaptation of it
(a fixed number of commits per step): there is no per-step budget, so the number of forwards per
block is data-dependent.
"""

from __future__ import annotations

import torch

from dllm_serve.decoding.commit import threshold_commit_rows


def near_anchor_rows(
    offsets: torch.Tensor, anchors: torch.Tensor, radius: torch.Tensor, span: int
) -> torch.Tensor:
    """Whether some anchor lies within ``radius[r]`` of each position (``[R, M]`` bool).

    ``offsets`` ``[R, M]`` are the positions' offsets in their block (``0 ≤ offset < span``;
    padding may repeat an offset, it is never an anchor), ``anchors`` ``[R, M]`` bool over them.
    Distances are canvas distances, so committed positions between two masked ones count
    (the neighbourhood ``[a − W, a + W]`` is an interval of the canvas). Computed with a prefix
    sum of anchor counts over the block: ``O(span)`` per row, no ``[M, M]`` matrix.
    """
    rows = offsets.shape[0]
    dense = torch.zeros(rows, span, dtype=torch.long, device=offsets.device)
    dense.scatter_add_(1, offsets, anchors.long())
    # prefix[j] = number of anchors at offsets < j; window count = prefix[hi] − prefix[lo].
    prefix = torch.nn.functional.pad(dense.cumsum(1), (1, 0))
    lo = (offsets - radius[:, None]).clamp(min=0)
    hi = (offsets + radius[:, None] + 1).clamp(max=span)
    return (prefix.gather(1, hi) - prefix.gather(1, lo)) > 0


def local_leap_commit_rows(
    confidence: torch.Tensor,
    offsets: torch.Tensor,
    anchor_threshold: torch.Tensor,
    neighbor_threshold: torch.Tensor,
    radius: torch.Tensor,
    span: int,
) -> torch.Tensor:
    """LocalLeap's commit set for one step, per row (``[R, M]`` bool).

    With κ = ``anchor_threshold``, τ = ``neighbor_threshold`` (τ ≤ κ), W = ``radius``::

        A      = {a masked in block : c_a ≥ κ}                 # anchors, this step only
        commit = {argmax c} ∪ {i : c_i ≥ κ} ∪ {i : c_i ≥ τ and |i − a| ≤ W for some a ∈ A}

    The paper's observation is that positions next to a confident prediction are themselves
    close to final ("local determinism"), and that this consistency decays with distance, so a
    relaxed threshold τ is safe only within W of an anchor. Anchors are positions that are
    masked *now* and reach κ in *this* step: a token committed earlier does not widen the
    relaxed region, and a τ-level neighbour committed this step does not become an anchor
    (one step of propagation). The argmax keeps progress when no position reaches κ, in
    which case exactly one token is committed. With W = 0 or τ = κ the rule is exactly
    :func:`~dllm_serve.decoding.commit.threshold_commit_rows` at κ.
    """
    anchors = confidence >= anchor_threshold[:, None]
    near = near_anchor_rows(offsets, anchors, radius, span)
    relaxed = near & (confidence >= neighbor_threshold[:, None])
    return threshold_commit_rows(confidence, anchor_threshold) | relaxed
