"""gumbel_argmax (exact float64 Gumbel-max) and top1_prob."""

from __future__ import annotations

import pytest
import torch

from dllm_serve.decoding.sampler import gumbel_argmax, top1_prob

LOGITS = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.2, -3.0])
DRAWS = 20_000


def _frequencies(temperature: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    tokens = gumbel_argmax(LOGITS.expand(DRAWS, -1), temperature, g)
    return torch.bincount(tokens, minlength=LOGITS.numel()).double() / DRAWS


@pytest.mark.parametrize("temperature", [1.0, 0.5, 1.7])
def test_gumbel_argmax_matches_softmax(temperature: float) -> None:
    expected = torch.softmax(LOGITS.double() / temperature, dim=-1)
    freq = _frequencies(temperature, seed=1234)
    stderr = torch.sqrt(expected * (1 - expected) / DRAWS)
    # within 4.5 standard errors per token (seeded, so not flaky), plus a chi-square check
    assert torch.all((freq - expected).abs() <= 4.5 * stderr + 1e-12), (freq, expected)
    counts = freq * DRAWS
    chi2 = (((counts - DRAWS * expected) ** 2) / (DRAWS * expected)).sum()
    assert chi2 < 25.0  # df = 5; p ≈ 1e-4


def test_temperature_zero_is_argmax_and_uses_no_rng() -> None:
    logits = torch.randn(7, 11, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(5)
    state = g.get_state()
    assert torch.equal(gumbel_argmax(logits, 0.0, g), logits.argmax(-1))
    assert torch.equal(g.get_state(), state)
    assert torch.equal(gumbel_argmax(logits, 0.0, None), logits.argmax(-1))


def test_same_generator_seed_same_sample() -> None:
    logits = torch.zeros(50, 9)
    a = gumbel_argmax(logits, 1.0, torch.Generator().manual_seed(3))
    b = gumbel_argmax(logits, 1.0, torch.Generator().manual_seed(3))
    c = gumbel_argmax(logits, 1.0, torch.Generator().manual_seed(4))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_large_logits_do_not_overflow() -> None:
    # exp(800) overflows float64; the log-space form must still sample correctly.
    logits = torch.tensor([[800.0, 799.0, -float("inf")]]).expand(4000, -1)
    tokens = gumbel_argmax(logits, 1.0, torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) <= {0, 1}
    p0 = float(torch.softmax(torch.tensor([800.0, 799.0], dtype=torch.float64), -1)[0])
    assert abs((tokens == 0).double().mean().item() - p0) < 0.03


def test_low_precision_and_empty_inputs() -> None:
    logits = torch.randn(4, 8).to(torch.bfloat16)
    out = gumbel_argmax(logits, 0.7, torch.Generator().manual_seed(0))
    assert out.shape == (4,) and out.dtype == torch.long
    assert gumbel_argmax(torch.empty(0, 8), 1.0, torch.Generator()).shape == (0,)
    assert top1_prob(torch.empty(0, 8), torch.empty(0, dtype=torch.long)).shape == (0,)
    with pytest.raises(ValueError):
        gumbel_argmax(torch.zeros(8), 1.0, None)


def test_top1_prob_is_the_softmax_of_token_in_the_logits_precision() -> None:
    logits = torch.randn(6, 13, generator=torch.Generator().manual_seed(1))
    tokens = torch.tensor([0, 3, 12, 5, 5, 7])
    single = top1_prob(logits, tokens)  # the engine's float32: no float64 copy of the logits
    assert single.dtype == torch.float32
    reference = torch.softmax(logits.double(), -1)[torch.arange(6), tokens]
    torch.testing.assert_close(single.double(), reference, rtol=1e-6, atol=0)
    logits = logits.double()  # float64 logits: float64 scores
    probs = top1_prob(logits, tokens)
    assert probs.dtype == torch.float64
    expected = torch.softmax(logits.double(), -1)[torch.arange(6), tokens]
    torch.testing.assert_close(probs, expected, rtol=1e-12, atol=0)
    # -inf entries (e.g. the suppressed mask id) contribute nothing
    masked = logits.clone()
    masked[:, 4] = -float("inf")
    expected = torch.softmax(masked.double(), -1)[torch.arange(6), tokens]
    torch.testing.assert_close(top1_prob(masked, tokens), expected, rtol=1e-12, atol=0)


def test_argmax_is_torch_argmax_with_first_maximum_on_ties() -> None:
    from dllm_serve.decoding.sampler import argmax

    for seed in range(10):
        z = torch.randn(6, 5, 300, generator=torch.Generator().manual_seed(seed))
        z[0, 0, 10] = z[0, 0].max()  # a tie: the first maximal index wins
        z[..., 3] = -float("inf")  # an excluded token
        z[1, 1, :] = 0.0  # every token tied
        z[2, 2, :] = -float("inf")
        z[2, 2, 299] = -5.0  # the maximum is the last entry
        want = z.argmax(dim=-1)
        assert torch.equal(argmax(z), want)
        assert torch.equal(argmax(z.double()), want)
