"""LocalLeap (arXiv:2510.07081): local determinism propagation around confident anchors.

The rule follows the authors' ``get_transfer_index`` (algorithms.md §2.2), not the
schedule-bound adaptation of §2.3: there is no per-step budget, so the number of forwards per
block is data-dependent.
"""

from __future__ import annotations

import torch

from dllm_serve.decoding.commit import threshold_commit


def near_anchor(positions: torch.Tensor, anchors: torch.Tensor, radius: int) -> torch.Tensor:
    """For each position, whether some anchor lies within ``radius`` of it (``[N]`` bool).

    ``positions`` ``[N]`` ascending canvas positions, ``anchors`` ``[N]`` bool over them.
    Distances are canvas distances, so committed positions between two masked ones count
    (the neighbourhood ``[a − W, a + W]`` is an interval of the canvas). Computed with a
    prefix sum of anchor counts over the covered span: ``O(span)``, no ``[N, N]`` matrix.
    """
    if positions.numel() == 0:
        return torch.zeros_like(anchors)
    offsets = positions - positions[0]
    span = int(offsets[-1]) + 1
    dense = torch.zeros(span, dtype=torch.long, device=positions.device)
    dense[offsets[anchors]] = 1
    # prefix[j] = number of anchors at offsets < j; window count = prefix[hi] − prefix[lo].
    prefix = torch.nn.functional.pad(dense.cumsum(0), (1, 0))
    lo = (offsets - radius).clamp(min=0)
    hi = (offsets + radius + 1).clamp(max=span)
    return (prefix[hi] - prefix[lo]) > 0


def local_leap_commit(
    confidence: torch.Tensor,
    positions: torch.Tensor,
    anchor_threshold: float,
    neighbor_threshold: float,
    radius: int,
) -> torch.Tensor:
    """LocalLeap's commit set for one step (``[N]`` bool over the block's masked positions).

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
    :func:`threshold_commit` at κ.
    """
    anchors = confidence >= anchor_threshold
    relaxed = near_anchor(positions, anchors, radius) & (confidence >= neighbor_threshold)
    return threshold_commit(confidence, anchor_threshold) | relaxed
