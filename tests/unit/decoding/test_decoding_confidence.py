"""Confidence metrics: top1_prob and entropy_inverse = exp(−H) (docs/decoding.md)."""

from __future__ import annotations

import math

import pytest
import torch
from one_row_rules import topk_commit

from dllm_serve.decoding.sampler import confidence, entropy_inverse, top1_prob


def _logits(n: int = 64, v: int = 50, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    # float64: these tests pin the math to 1e-12; the engine passes its float32 logits.
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)).double() * scale


def test_entropy_inverse_is_exp_minus_entropy() -> None:
    z = _logits()
    p = torch.softmax(z.double(), -1)
    entropy = -(p * p.log()).sum(-1)
    got = entropy_inverse(z, z.argmax(-1))
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, torch.exp(-entropy), rtol=1e-12, atol=0)


def test_float32_logits_give_float32_scores_close_to_float64() -> None:
    z = _logits()
    for metric in (top1_prob, entropy_inverse):
        single = metric(z.float(), z.argmax(-1))
        assert single.dtype == torch.float32
        torch.testing.assert_close(single.double(), metric(z, z.argmax(-1)), rtol=1e-5, atol=0)


def test_entropy_inverse_scale() -> None:
    # one-hot → 1; uniform over k tokens → 1/k; always in (0, 1] and ≤ the top-1 probability
    one_hot = torch.full((1, 10), -float("inf"), dtype=torch.float64)
    one_hot[0, 3] = 0.0
    assert entropy_inverse(one_hot, torch.tensor([3])).item() == 1.0
    for k in (1, 2, 7, 40):
        z = torch.full((1, 40), -float("inf"), dtype=torch.float64)
        z[0, :k] = 1.5
        assert math.isclose(entropy_inverse(z, torch.tensor([0])).item(), 1 / k, rel_tol=1e-12)
    z = _logits(n=500, scale=5.0)
    c = entropy_inverse(z, z.argmax(-1))
    assert torch.all((c > 0) & (c <= 1))
    # H ≥ min-entropy ⇒ exp(−H) ≤ max p: a threshold on entropy_inverse is never looser
    assert torch.all(c <= top1_prob(z, z.argmax(-1)) + 1e-12)


def test_entropy_inverse_ignores_minus_inf_and_proposal() -> None:
    z = _logits(n=8, v=12)
    masked = z.clone()
    masked[:, 5] = -float("inf")
    kept = torch.cat([z[:, :5], z[:, 6:]], dim=1)
    expected = entropy_inverse(kept, kept.argmax(-1))
    torch.testing.assert_close(entropy_inverse(masked, masked.argmax(-1)), expected)
    # the score is a property of the distribution, not of the proposed token
    assert torch.equal(
        entropy_inverse(z, torch.zeros(8, dtype=torch.long)), entropy_inverse(z, z.argmax(-1))
    )


def test_ranking_is_invariant_under_monotone_transforms_of_minus_entropy() -> None:
    for seed in range(20):
        z = _logits(n=32, v=30, seed=seed, scale=2.0)
        p = torch.softmax(z.double(), -1)
        entropy = -(p * p.log()).sum(-1)
        score = entropy_inverse(z, z.argmax(-1))
        for transformed in (-entropy, 1 / (1 + entropy), torch.exp(-2 * entropy), -(entropy**3)):
            for k in (1, 5, 17, 32):
                assert torch.equal(topk_commit(score, k), topk_commit(transformed, k))


def test_dispatch_and_low_precision() -> None:
    z = _logits(n=6, v=9).to(torch.bfloat16)
    x0 = z.argmax(-1)
    assert torch.equal(confidence("top1_prob", z, x0), top1_prob(z, x0))
    assert torch.equal(confidence("entropy_inverse", z, x0), entropy_inverse(z, x0))
    assert entropy_inverse(torch.empty(0, 9), torch.empty(0, dtype=torch.long)).shape == (0,)
    with pytest.raises(ValueError, match="unknown confidence_metric"):
        confidence("margin", z, x0)
