"""Exactness of the ISD sampling rule: enumeration on small vocabularies, and Monte Carlo."""

from __future__ import annotations

import pytest
import torch

from dllm_serve.decoding.params import DecodingParams
from dllm_serve.decoding.sampler import sample, target_probs
from dllm_serve.decoding.selfspec import ISDecoder, residual, verify_row
from dllm_serve.engine.model_runner import ModelRunner
from dllm_serve.models.kv_pool import PAGE_SIZE
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


def accept_probability(p: torch.Tensor, q: torch.Tensor, x: int) -> float:
    """``min(1, p(x) / q(x))``: the acceptance probability the kernel's ``u·q(x) < p(x)``
    test realises (local, for the enumeration and the published rule)."""
    return min(1.0, float(p[x]) / float(q[x]))


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


def verify_one(p: torch.Tensor, q: torch.Tensor, x: int, gen: torch.Generator) -> int:
    """The kernel on a single draft ``x ~ q``: the emitted token (``x`` or its correction)."""
    accepted, corrections = verify_row(p[None], q[None], torch.tensor([x]), gen)
    return x if int(accepted) == 1 else int(corrections[0])


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
    outs = [verify_one(p, q, x, gen) for x in drafts]
    freq = torch.bincount(torch.tensor(outs), minlength=5).double() / n
    assert 0.5 * float((freq - p).abs().sum()) < 0.02


def test_verify_row_is_sequentially_exact_monte_carlo() -> None:
    """Two specs: the 1st emitted token ~ p0 and, when spec 0 was accepted, the 2nd ~ p1.

    Seeded (deterministic); 10k trials, TV < 0.03 for the first token (expected ≈ 0.01) and
    < 0.05 for the second (≈ 6k samples, expected ≈ 0.015).
    """
    gen = torch.Generator().manual_seed(7)
    p = torch.tensor([[0.6, 0.1, 0.3, 0.0], [0.1, 0.2, 0.3, 0.4]], dtype=torch.float64)
    q = torch.tensor([[0.3, 0.3, 0.2, 0.2], [0.0, 0.5, 0.25, 0.25]], dtype=torch.float64)
    first, second = [], []
    for _ in range(10_000):
        specs = sample(q, gen)
        accepted, corrections = verify_row(p, q, specs, gen)
        j, specs_list = int(accepted), specs.tolist()
        emitted = [*specs_list[:j], int(corrections[j])] if j < 2 else specs_list
        first.append(emitted[0])
        if j >= 1:
            second.append(emitted[1])
    for samples, target, bound in ((first, p[0], 0.03), (second, p[1], 0.05)):
        freq = torch.bincount(torch.tensor(samples), minlength=4).double() / len(samples)
        assert 0.5 * float((freq - target).abs().sum()) < bound


def test_verify_row_accepts_the_leading_run_and_corrects_from_the_residual() -> None:
    """Deterministic cases: a ≥ 1 always accepts, p(x) = 0 always rejects, acceptance stops
    at the first rejection, and every correction lies in the support of max(0, p − q)."""
    gen = torch.Generator().manual_seed(3)
    p = torch.tensor([[0.7, 0.3, 0.0], [0.0, 0.5, 0.5], [0.2, 0.8, 0.0]], dtype=torch.float64)
    q = torch.tensor([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [0.2, 0.8, 0.0]], dtype=torch.float64)
    for _ in range(200):
        # spec 0 = 0 (p ≥ q: accepted), spec 1 = 0 (p = 0: rejected), spec 2 accepted alone.
        accepted, corrections = verify_row(p, q, torch.tensor([0, 0, 1]), gen)
        assert int(accepted) == 1  # the accepted spec 2 after the rejection does not count
        assert corrections.shape == (3,)
        assert int(corrections[0]) == 0  # residual of row 0 is max(0, p − q) = [.2, 0, 0]
        assert int(corrections[1]) == 2  # residual of row 1 is [0, 0, .5]
        assert int(corrections[2]) in (0, 1)  # p == q: no residual, the kernel falls back to p
    accepted, corrections = verify_row(p[:0], q[:0], torch.tensor([], dtype=torch.long), gen)
    assert int(accepted) == 0 and corrections.numel() == 0


def test_verify_row_corrections_follow_the_residual_on_every_pair() -> None:
    """The kernel's K corrections are independent draws of each spec's residual (the
    enumeration-checked ``residual``, p itself when p == q): K = 4000 copies of one (p, q)
    give 4000 draws; TV < 0.05 on every pair of ``_pairs()`` (expected ≲ 0.02; seeded)."""
    gen = torch.Generator().manual_seed(99)
    k = 4000
    for p, q in _pairs():
        specs = sample(q.expand(k, -1), gen)
        _, corrections = verify_row(p.expand(k, -1), q.expand(k, -1), specs, gen)
        freq = torch.bincount(corrections, minlength=p.numel()).double() / k
        assert 0.5 * float((freq - residual(p, q)).abs().sum()) < 0.05, (p, q)


def test_verify_row_consumes_randomness_by_k_alone() -> None:
    """All K uniforms and K corrections are drawn up front, whatever the verdict: the
    generator ends in the same state for an all-accept and an immediate-reject round."""
    p = torch.tensor([[0.6, 0.4, 0.0], [0.0, 0.5, 0.5]], dtype=torch.float64)
    q = torch.tensor([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0]], dtype=torch.float64)
    after = []
    for specs in ([0, 1], [2, 0], [0, 0]):  # all accepted / rejected at 0 / rejected at 1
        gen = torch.Generator().manual_seed(11)
        verify_row(p, q, torch.tensor(specs), gen)
        after.append(torch.rand(4, generator=gen, dtype=torch.float64))
    assert all(torch.equal(a, after[0]) for a in after[1:])


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
    decoder = ISDecoder(idlm.mask_id, (), stride=3)
    params = [DecodingParams(gen_length=3, steps=3, temperature=temperature, seed=s)
              for s in range(n)]  # fmt: skip
    per_row = decoder.kv_tokens(len(prompt), params[0])
    runner = ModelRunner(idlm.model, torch.device("cpu"), kv_slots=n * whole_pages(per_row))
    assert runner.pool is not None
    states = [decoder.init_state(prompt, q, "cpu") for q in params]
    for s in states:
        s.kv = runner.pool.reserve(per_row)
    with torch.inference_mode():
        while live := [s for s in states if not s.finished]:
            logits = runner.run([decoder.prepare(s) for s in live])
            decoder.commit(live, decoder.sample(live, logits).tolist())
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


def whole_pages(tokens: int) -> int:
    """``tokens`` rounded up to whole KV pages: what one request's reservation takes."""
    return -(-tokens // PAGE_SIZE) * PAGE_SIZE
