"""LinearSpec at T > 0 is sample-and-match: every emitted token is an exact sample of the
causal (AR) distribution given the emitted prefix, whatever the drafts.

End to end on a tiny Nemotron-format model: many seeded requests of three tokens, batched as
rows, against the exact AR joint of (t0, t1, t2) by enumeration. The drafts are forced to the
AR argmax so the accept path (two tokens from one verify) and the reject path (a second round)
both occur often.
"""

from __future__ import annotations

import pytest
import torch
from trimode_support import CPU, drive

from dllm_serve.decoding.linear_spec import DRAFT, VERIFY, LinearSpecDecoder
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.decoding.sampler import sample_inverse_cdf, target_probs
from dllm_serve.engine.model_runner import ModelRunner
from dllm_serve.models.kv_pool import PAGE_SIZE
from dllm_serve.models.loader import LoadedModel

pytestmark = pytest.mark.usefixtures("one_thread")


def test_inverse_cdf_draws_follow_p_and_never_zero_entries() -> None:
    """Seeded (deterministic): 20k draws per row, TV < 0.02 (expected ≈ 0.006)."""
    p = torch.tensor([[0.5, 0.0, 0.3, 0.2], [0.0, 0.0, 1.0, 0.0], [0.1, 0.2, 0.3, 0.4]],
                     dtype=torch.float64)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    draws = sample_inverse_cdf(p.repeat(20000, 1), gen).view(20000, 3)
    for row in range(3):
        freq = torch.bincount(draws[:, row], minlength=4).double() / 20000
        assert 0.5 * (freq - p[row]).abs().sum() < 0.02
        assert freq[p[row] == 0].sum() == 0


def ar_joint(loaded: LoadedModel, prompt: list[int], temperature: float):
    """``{t0: [V, V]}``: the exact AR probability of (t0, t1, t2) for every t0 of probability
    > 1e-6 (one batched forward of all V continuations per such t0)."""
    model, v, p = loaded.model, loaded.vocab_size, len(prompt)
    causal = torch.tril(torch.ones(p + 2, p + 2, dtype=torch.bool))[None, None]
    with torch.inference_mode():
        first = model(torch.tensor([prompt]), torch.arange(p)[None], causal[..., :p, :p])
        p0 = target_probs(model.lm_head(first[0, -1:]), temperature, loaded.mask_id)[0]
        joint = {}
        for t0 in torch.nonzero(p0 > 1e-6).flatten().tolist():
            ids = torch.tensor([[*prompt, t0, t] for t in range(v)])
            hidden = model(ids, torch.arange(p + 2).expand(v, p + 2), causal)
            logits = model.lm_head(hidden[:, -2:])
            p1 = target_probs(logits[:1, 0], temperature, loaded.mask_id)[0]
            p2 = target_probs(logits[:, 1], temperature, loaded.mask_id)
            joint[t0] = p0[t0] * p1[:, None] * p2
    return joint


def test_sample_and_match_is_exactly_ar_distributed(nemotron: LoadedModel) -> None:
    """χ² over cells with expected count ≥ 5 plus one pooled cell, below dof + 6·sqrt(2·dof)
    (~6 sigma); deterministic seeds, so it cannot flake. T = 0.01: the random tiny model is
    nearly uniform at T = 1 (no cell would reach an expected count of 5); t0 values left out of
    the enumeration (total probability < 1e-3) fall in the pooled cell."""
    prompt, temperature, n = [201, 305, 150], 0.01, 800
    joint = ar_joint(nemotron, prompt, temperature)
    decoder = LinearSpecDecoder(nemotron.mask_id, (), block_size=8)
    params = [DecodingParams(gen_length=3, steps=3, temperature=temperature, seed=s)
              for s in range(n)]  # fmt: skip
    per_row = decoder.kv_tokens(len(prompt), params[0])
    runner = ModelRunner(nemotron.model, CPU, kv_slots=n * whole_pages(per_row))
    assert runner.pool is not None
    states = [decoder.init_state(prompt, q, "cpu") for q in params]
    for s in states:
        s.kv = runner.pool.reserve(per_row)

    def oracle(state, phase: str) -> None:  # the most likely t1 given the sampled t0
        if phase == DRAFT and state.phase == VERIFY:
            state.specs = [int(joint[state.seed].sum(-1).argmax())]

    drive(runner, decoder, states, oracle)
    accepted = sum(s.accepted_drafts for s in states)
    assert 0.3 * n < accepted < n  # both paths ran, many times
    v = nemotron.vocab_size
    support = sorted(joint)
    observed = torch.zeros(len(support), v, v, dtype=torch.float64)
    outside = 0
    for s in states:
        t0, t1, t2 = s.emitted
        if t0 in joint:
            observed[support.index(t0), t1, t2] += 1
        else:
            outside += 1
    expected = torch.stack([joint[t0] for t0 in support]) * n
    missing = n - float(expected.sum())  # the t0 values left out
    assert 0 <= missing < 1e-3 * n
    big = expected >= 5
    obs = torch.cat([observed[big], (observed[~big].sum() + outside)[None]])
    exp = torch.cat([expected[big], (expected[~big].sum() + missing)[None]])
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    dof = int(big.sum())
    assert dof >= 5, "the test needs a concentrated distribution"
    assert chi2 < dof + 6 * (2 * dof) ** 0.5, (chi2, dof)


def test_same_seed_same_tokens_whatever_the_batch(nemotron: LoadedModel) -> None:
    decoder = LinearSpecDecoder(nemotron.mask_id, nemotron.stop_ids, block_size=4)
    runner = ModelRunner(nemotron.model, CPU, kv_slots=512)
    assert runner.pool is not None

    def answer(prompts: list[list[int]]) -> list[list[int]]:
        params = DecodingParams(gen_length=10, steps=10, temperature=0.8, seed=7)
        states = [decoder.init_state(p, params, "cpu") for p in prompts]
        for s in states:
            s.kv = runner.pool.reserve(decoder.kv_tokens(len(s.prompt_ids), params))
        drive(runner, decoder, states)
        for s in states:
            runner.pool.free(s.kv)
        return [s.emitted for s in states]

    solo = answer([[201, 305, 150]])[0]
    assert answer([[512, 140], [201, 305, 150], [777]])[1] == solo


def whole_pages(tokens: int) -> int:
    """``tokens`` rounded up to whole KV pages: what one request's reservation takes."""
    return -(-tokens // PAGE_SIZE) * PAGE_SIZE
