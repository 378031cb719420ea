"""Commit rules on given confidences: top-k, threshold (Fast-dLLM), LocalLeap (§2.4)."""

from __future__ import annotations

import pytest
import torch
from one_row_rules import local_leap_commit, near_anchor, threshold_commit, topk_commit

from dllm_serve.decoding.commit_rules import argmax_onehot, topk_commit_rows

KAPPA, TAU, W = 0.9, 0.75, 4


def _cases(trials: int = 400, seed: int = 0):
    """Random steps: confidences of the masked positions of a block and their positions.

    Positions are a random subset of a 32-wide block (committed positions in between), and
    confidences cluster near the thresholds so every branch of the rules is exercised.
    """
    g = torch.Generator().manual_seed(seed)
    for _ in range(trials):
        n_masked = int(torch.randint(1, 33, (1,), generator=g))
        positions = torch.randperm(32, generator=g)[:n_masked].sort().values + 100
        c = torch.rand(n_masked, generator=g, dtype=torch.float64)
        c = torch.where(c < 0.5, c * 1.6, 0.7 + 0.3 * torch.rand(n_masked, generator=g))
        yield c.to(torch.float64), positions


def _brute_near(positions: torch.Tensor, anchors: torch.Tensor, radius: int) -> torch.Tensor:
    a = positions[anchors]
    return ((positions[:, None] - a[None, :]).abs() <= radius).any(dim=1)


def test_topk_commit_counts_and_ties() -> None:
    c = torch.tensor([0.2, 0.9, 0.5, 0.9, 0.1], dtype=torch.float64)
    assert topk_commit(c, 0).tolist() == [False] * 5
    assert topk_commit(c, 1).tolist() == [False, True, False, False, False]  # lowest index
    assert topk_commit(c, 3).tolist() == [False, True, True, True, False]
    assert topk_commit(c, 5).all()


def test_one_commit_per_row_is_the_top_1_of_the_stable_sort() -> None:
    # The sampler commits one position per row through argmax_onehot when every top-k row's k
    # is 1: on ties (here, exact repeats) and -inf padding it must pick what the sort ranks
    # first, the lowest position among the most confident.
    g = torch.Generator().manual_seed(0)
    c = torch.randint(0, 4, (64, 12), generator=g).float() / 4  # many ties
    c[::3, 7:] = float("-inf")  # ragged rows: padding after their masked positions
    one = torch.ones(64, dtype=torch.long)
    assert torch.equal(argmax_onehot(c), topk_commit_rows(c, one))


def test_threshold_commit() -> None:
    c = torch.tensor([0.2, 0.95, 0.5, 0.91, 0.1], dtype=torch.float64)
    original = c.clone()
    assert threshold_commit(c, 0.9).tolist() == [False, True, False, True, False]
    assert torch.equal(c, original)  # the confidences are not mutated
    # nothing reaches the threshold: exactly the argmax (lowest index among ties)
    low = torch.tensor([0.3, 0.6, 0.6, 0.1], dtype=torch.float64)
    assert threshold_commit(low, 0.9).tolist() == [False, True, False, False]
    assert threshold_commit(low, 1.0).sum() == 1
    assert threshold_commit(torch.tensor([0.5], dtype=torch.float64), 0.9).tolist() == [True]


@pytest.mark.parametrize("radius", [0, 1, 2, 4, 9, 40])
def test_near_anchor_matches_brute_force(radius: int) -> None:
    for c, positions in _cases(trials=150, seed=radius):
        anchors = c >= KAPPA
        assert torch.equal(
            near_anchor(positions, anchors, radius), _brute_near(positions, anchors, radius)
        )


@pytest.mark.parametrize(
    ("kappa", "tau", "radius"), [(0.9, 0.75, 4), (0.8, 0.5, 1), (0.95, 0.6, 16)]
)
def test_local_leap_properties(kappa: float, tau: float, radius: int) -> None:
    for c, positions in _cases(seed=int(kappa * 100) + radius):
        got = local_leap_commit(c, positions, kappa, tau, radius)
        strict, relaxed = threshold_commit(c, kappa), threshold_commit(c, tau)
        # 1. superset of threshold(κ), subset of threshold(τ)
        assert torch.all(got >= strict) and torch.all(got <= relaxed)
        anchors = c >= kappa
        near = _brute_near(positions, anchors, radius)
        argmax = int(c.argmax())
        # 2. soundness: every commit but the argmax is ≥ κ, or ≥ τ within W of an anchor
        for i in torch.nonzero(got).squeeze(1).tolist():
            assert i == argmax or c[i] >= kappa or (c[i] >= tau and near[i])
        # 3. completeness: nothing that qualifies is left masked
        assert torch.all(got[anchors])
        assert torch.all(got[near & (c >= tau)])
        assert got[argmax]
        # 4. no anchor ⇒ exactly one commit, the argmax
        if not anchors.any():
            assert got.sum() == 1
        # 5. W = 0 or τ = κ ⇒ exactly threshold decoding at κ
        assert torch.equal(local_leap_commit(c, positions, kappa, tau, 0), strict)
        assert torch.equal(local_leap_commit(c, positions, kappa, kappa, radius), strict)


def test_local_leap_one_step_of_propagation_and_distances() -> None:
    # anchor at 100; 102 is a τ-neighbour and commits; 104 is 2 away from 102 but 4 from the
    # anchor (W = 2): a neighbour committed this step is not an anchor itself.
    positions = torch.tensor([100, 102, 104, 110])
    c = torch.tensor([0.95, 0.8, 0.8, 0.85], dtype=torch.float64)
    assert local_leap_commit(c, positions, 0.9, 0.75, 2).tolist() == [True, True, False, False]
    # distances are canvas distances: with committed positions in between, 104 is 4 away
    assert local_leap_commit(c, positions, 0.9, 0.75, 4).tolist() == [True, True, True, False]
    # 110 qualifies only through an anchor within W
    assert local_leap_commit(c, positions, 0.9, 0.75, 10).tolist() == [True, True, True, True]


def test_near_anchor_edge_cases() -> None:
    empty = torch.empty(0, dtype=torch.long)
    assert near_anchor(empty, torch.empty(0, dtype=torch.bool), 3).shape == (0,)
    positions = torch.tensor([5, 6, 7])
    assert not near_anchor(positions, torch.zeros(3, dtype=torch.bool), 16).any()
