"""Exactness of the ISD sampling rule: enumeration on small vocabularies, and Monte Carlo."""

from __future__ import annotations

import pytest
import torch

from dllm_serve.decoding.isd import ISDecoder
from dllm_serve.decoding.isd_verify import (
    accept_probability,
    residual,
    sample,
    target_probs,
    verify_draft,
    verify_specs,
)
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.engine.batch import build_batch, run_batch
from dllm_serve.models.loader import LoadedModel


def _pairs() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random (p, q) on V = 2..6 plus the edge cases: p == q, disjoint supports, one-hots."""
    gen = torch.Generator().manual_seed(0)
    pairs = []
    for v in range(2, 7):
        for _ in range(40):
            # Sparse-ish rows: zeros make the residual and min(1, p/q) corner cases likely.
            raw = torch.rand(2, v, generator=gen, dtype=torch.float64)
            raw[raw < 0.2] = 0.0
            raw[:, 0] += 1e-3  # keep every row summing to > 0
            p, q = raw / raw.sum(dim=1, keepdim=True)
            pairs.append((p, q))
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    pairs += [
        (p, p.clone()),  # zero residual: every draft accepted
        (p, torch.tensor([0.4, 0.35, 0.25], dtype=torch.float64)),  # §1.3 counterexample
        (torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64), p),  # one-hot target (T → 0)
        (p, torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64)),  # one-hot draft
        (torch.tensor([0.5, 0.5, 0.0, 0.0], dtype=torch.float64),
         torch.tensor([0.0, 0.0, 0.5, 0.5], dtype=torch.float64)),  # disjoint supports
    ]  # fmt: skip
    return pairs


def exact_rule_output(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """P(out = y) for x ~ q, accept w.p. min(1, p/q), else y ~ residual (by enumeration)."""
    out = torch.zeros_like(p)
    r = residual(p, q)
    for x in range(p.numel()):
        if q[x] == 0:
            continue  # x is never drafted
        a = accept_probability(p, q, x)
        out[x] += q[x] * a
        out += q[x] * (1 - a) * r
    return out


def published_mix_output(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The I-DLM server's rule: draft argmax q, then min(1, p/q) and the max(0, p − q) residual."""
    x = int(q.argmax())
    a = min(1.0, float(p[x] / q[x]))
    out = (1 - a) * residual(p, q)
    out[x] += a
    return out


def test_exact_rule_reproduces_p_by_enumeration() -> None:
    for p, q in _pairs():
        assert torch.allclose(exact_rule_output(p, q), p, atol=1e-12, rtol=0)


def test_published_argmax_mix_is_biased() -> None:
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.4, 0.35, 0.25], dtype=torch.float64)
    # argmax q = 0 and p(0) ≥ q(0): always accepted, token 0 with probability 1 instead of .5
    assert published_mix_output(p, q).tolist() == [1.0, 0.0, 0.0]
    worst = max(0.5 * float((published_mix_output(p, q) - p).abs().sum()) for p, q in _pairs())
    assert worst > 0.4  # total-variation error of the published rule; the exact one is 0


def test_sample_and_verify_are_p_distributed_monte_carlo() -> None:
    """Seeded, so deterministic: 20k draws, TV < 0.02 (the expected TV here is ≈ 0.006)."""
    gen = torch.Generator().manual_seed(1234)
    p = torch.tensor([0.05, 0.4, 0.0, 0.3, 0.25], dtype=torch.float64)
    q = torch.tensor([0.3, 0.1, 0.2, 0.4, 0.0], dtype=torch.float64)
    n = 20_000
    drawn = sample(p.expand(n, -1), gen)
    assert not bool((drawn == 2).any())  # zero-probability token never drawn
    freq = torch.bincount(drawn, minlength=5).double() / n
    assert 0.5 * float((freq - p).abs().sum()) < 0.02
    drafts = sample(q.expand(n, -1), gen).tolist()
    outs = [verify_draft(p, q, x, gen)[1] for x in drafts]
    freq = torch.bincount(torch.tensor(outs), minlength=5).double() / n
    assert 0.5 * float((freq - p).abs().sum()) < 0.02


def test_verify_specs_is_sequentially_exact_monte_carlo() -> None:
    """Two specs: the 1st emitted token ~ p0 and, when spec 0 was accepted, the 2nd ~ p1.

    Seeded (deterministic); 10k trials, TV < 0.03 for the first token (expected ≈ 0.01) and
    < 0.05 for the second (≈ 6k samples, expected ≈ 0.015).
    """
    gen = torch.Generator().manual_seed(7)
    p = torch.tensor([[0.6, 0.1, 0.3, 0.0], [0.1, 0.2, 0.3, 0.4]], dtype=torch.float64)
    q = torch.tensor([[0.3, 0.3, 0.2, 0.2], [0.0, 0.5, 0.25, 0.25]], dtype=torch.float64)
    first, second = [], []
    for _ in range(10_000):
        specs = sample(q, gen).tolist()
        j, correction = verify_specs(p, q, specs, gen)
        emitted = [*specs[:j], correction] if correction is not None else specs
        first.append(emitted[0])
        if j >= 1:
            second.append(emitted[1])
    for samples, target, bound in ((first, p[0], 0.03), (second, p[1], 0.05)):
        freq = torch.bincount(torch.tensor(samples), minlength=4).double() / len(samples)
        assert 0.5 * float((freq - target).abs().sum()) < bound


def test_greedy_target_is_the_t0_limit() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 9.0]])
    probs = target_probs(logits, 1e-3, mask_id=3)  # the mask id is never a target
    assert probs[0, 3] == 0 and int(probs[0].argmax()) == 1


# ---- end to end on a tiny I-DLM model ------------------------------------------------------


pytestmark = pytest.mark.usefixtures("one_thread")


def ar_joint(loaded: LoadedModel, prompt: list[int], temperature: float) -> torch.Tensor:
    """Exact AR distribution of the first two answer tokens, ``[V, V]`` (one batched forward)."""
    model, v = loaded.model, loaded.model.config.vocab_size
    n = len(prompt) + 1
    ids = torch.tensor([[*prompt, t] for t in range(v)])
    mask = torch.tril(torch.ones(n, n, dtype=torch.bool))[None, None]
    with torch.inference_mode():
        hidden = model(ids, torch.arange(n).expand(v, n), mask)
        logits = model.lm_head(hidden[:, -2:])
    first = target_probs(logits[:1, 0], temperature, loaded.mask_id)[0]
    second = target_probs(logits[:, 1], temperature, loaded.mask_id)
    return first[:, None] * second


def test_end_to_end_isd_sampling_matches_ar(idlm: LoadedModel) -> None:
    """Many seeded requests batched as rows; the (t0, t1) histogram vs the exact AR joint.

    t1 always goes through verification (N = 3: the cold start drafts it, the next round
    verifies it). Deterministic seeds, so the result cannot flake; the threshold (χ² over
    cells with expected count ≥ 5 plus one pooled cell, below dof + 6·sqrt(2·dof), ~6 sigma)
    would also hold for almost any other seed set. T = 0.05 because the random tiny model is
    nearly uniform at T = 1 (no cell would reach an expected count of 5).
    """
    prompt, temperature, n = [5, 17, 8], 0.05, 800
    joint = ar_joint(idlm, prompt, temperature).flatten()
    decoder = ISDecoder(idlm.model, idlm.mask_id, (), stride=3)
    states = [
        decoder.init_state(prompt, DecodingParams(gen_length=3, steps=3, temperature=temperature,
                                                  seed=s), "cpu")
        for s in range(n)
    ]  # fmt: skip
    with torch.inference_mode():
        while live := [s for s in states if not s.finished]:
            batch = build_batch([decoder.prepare(s) for s in live], pad_id=idlm.mask_id)
            for s, logits in zip(live, run_batch(idlm.model, batch), strict=True):
                decoder.update(s, logits)
    assert sum(s.drafted for s in states) >= n  # the second token was verified in every row
    v = idlm.model.config.vocab_size
    cells = torch.tensor([s.emitted[0] * v + s.emitted[1] for s in states])
    observed = torch.bincount(cells, minlength=v * v).double()
    expected = joint * n
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    dof = int(big.sum())
    assert dof >= 5, "the test needs a concentrated distribution"
    assert chi2 < dof + 6 * (2 * dof) ** 0.5, (chi2, dof)
