"""LLaDADenoiser: per-step invariants (algorithms.md §1.9, §7), early stop, RNG, answer helpers."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from decoding_mock import (
    EOS_ID,
    EOT_ID,
    MASK_ID,
    MockLM,
    StepRecord,
    run,
    step,
    truncate_at_stop,
)

from dllm_serve.decoding.blocks import DenoiseState
from dllm_serve.decoding.canvas import LLaDADenoiser
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.decoding.protocol import AttentionKind

PROMPT = [5, 17, 8, 30, 11]
STOPS = (EOS_ID, EOT_ID)
# (gen_length, block_length, steps): single block, semi-AR, uneven counts per step
CONFIGS = [(16, 16, 16), (16, 4, 8), (24, 8, 12), (12, 4, 12), (20, 5, 8), (16, 8, 4)]


def _params(gen: int, block: int, steps: int, temperature: float = 0.0, seed=None):
    return DecodingParams(
        gen_length=gen, block_length=block, steps=steps, temperature=temperature, seed=seed
    )


def _decode(params: DecodingParams, model: MockLM, stop_ids=(), prompt=PROMPT):
    denoiser = LLaDADenoiser(MASK_ID, stop_ids)
    state = denoiser.init_state(prompt, params, "cpu")
    return state, run(denoiser, state, model)


def _check_step(rec: StepRecord, prompt_len: int, block_length: int) -> None:
    changed = torch.nonzero(rec.before != rec.after).squeeze(1)
    # count: exactly the scheduled number, all inside the active block, all previously masked
    assert changed.numel() == rec.scheduled == rec.result.committed
    assert torch.all((changed >= rec.lo) & (changed < rec.hi))
    assert torch.all(rec.before[changed] == MASK_ID)
    assert torch.all(rec.after[changed] != MASK_ID)
    # logits were requested for exactly the active block's masks, ascending
    expected_index = torch.nonzero(rec.before[rec.lo : rec.hi] == MASK_ID).squeeze(1) + rec.lo
    assert torch.equal(rec.logits_index, expected_index)
    # semi-AR order: earlier blocks full, later blocks untouched
    assert torch.all(rec.before[prompt_len : rec.lo] != MASK_ID)
    assert torch.all(rec.after[rec.hi :] == MASK_ID)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize(("gen", "block", "steps"), CONFIGS)
def test_step_invariants(gen: int, block: int, steps: int, temperature: float) -> None:
    params = _params(gen, block, steps, temperature, seed=7)
    state, records = _decode(params, MockLM(seed=1))
    prompt = torch.tensor(PROMPT)
    for rec in records:
        _check_step(rec, len(PROMPT), block)
        assert torch.equal(rec.after[: len(PROMPT)], prompt)
        # committed tokens are never rewritten
        committed = rec.before != MASK_ID
        assert torch.equal(rec.after[committed], rec.before[committed])
    assert torch.equal(state.canvas[: len(PROMPT)], prompt)
    assert not torch.any(state.canvas == MASK_ID)
    assert state.nfe == steps == len(records)
    assert state.committed == gen
    assert state.finished and state.finish_reason == "length"
    # every block used its own uniform schedule
    per_block = [[r.scheduled for r in records if r.block == k] for k in range(gen // block)]
    spb = params.steps_per_block
    assert all(s == [block // spb + (i < block % spb) for i in range(spb)] for s in per_block)


def test_mask_id_never_committed_even_if_the_model_prefers_it() -> None:
    model = MockLM(seed=2, mask_logit=50.0)  # the mask id is every position's top logit
    for temperature in (0.0, 1.0):
        state, records = _decode(_params(12, 4, 6, temperature, seed=3), model)
        for rec in records:
            _check_step(rec, len(PROMPT), 4)
        assert not torch.any(state.canvas == MASK_ID)


def test_more_steps_than_block_positions() -> None:
    # steps_per_block (6) > block_length (4): the uniform schedule's trailing zero-commit
    # steps would change nothing, so a block ends as soon as nothing in it is masked (they
    # used to be forwards with no position to score, which the engine's packer refused).
    state, records = _decode(_params(8, 4, 12), MockLM(seed=3))
    assert [r.result.committed for r in records] == [1] * 8
    assert all(r.logits_index.numel() > 0 for r in records)
    assert state.nfe == 8 and state.finish_reason == "length"


def _eos_model(seed: int, position: int) -> MockLM:
    model = MockLM(seed=seed)
    model.bias[position, EOS_ID] = 30.0  # EOS is (by far) the most confident proposal there
    model.bias[:, EOT_ID] = -30.0
    return model


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize(("gen", "block", "steps"), [(16, 4, 16), (16, 16, 16), (24, 8, 12)])
def test_early_stop_is_exact(gen: int, block: int, steps: int, temperature: float) -> None:
    model = _eos_model(seed=4, position=len(PROMPT) + 3)
    if block == gen:
        # One block commits in confidence order, not left to right: make the answer's prefix
        # confident too, or it may be the last thing committed (and nothing is saved).
        model.bias[len(PROMPT) : len(PROMPT) + 3, 10] = 25.0
    params = _params(gen, block, steps, temperature, seed=11)
    early, _ = _decode(params, model, stop_ids=STOPS)
    full, _ = _decode(params, model, stop_ids=())
    assert early.finished and early.finish_reason == "stop"
    assert early.nfe < full.nfe == steps
    assert full.finish_reason == "length"
    answer = full.canvas[len(PROMPT) :].tolist()
    assert EOS_ID in answer
    assert early.answer_tokens() == truncate_at_stop(answer, STOPS)
    # the early-stopped run is a prefix of the full run's trajectory
    done = early.canvas != MASK_ID
    assert torch.equal(early.canvas[done], full.canvas[done])


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("limit", [1, 9, 13, 16])
def test_an_answer_limit_cuts_the_same_canvas(temperature: float, limit: int) -> None:
    """A canvas of 16 limited to ``limit`` answer tokens is the unlimited canvas's decode, cut:
    the same tokens up to the limit, then "length", never a token past it."""
    params = _params(16, 4, 16, temperature, seed=3)
    full, _ = _decode(params, MockLM(seed=2))
    limited, records = _decode(dataclasses.replace(params, answer_limit=limit), MockLM(seed=2))
    assert limited.finished and limited.finish_reason == "length"
    assert limited.answer_tokens() == full.answer_tokens()[:limit]
    assert limited.final_len == limit
    # It stops as soon as the limit's positions are final: no step of a later block runs.
    assert all(r.lo < len(PROMPT) + limit for r in records)
    assert limited.nfe <= full.nfe


def test_an_answer_limit_must_fit_the_canvas() -> None:
    for bad in (0, 17):
        with pytest.raises(ValueError, match="answer_limit"):
            DecodingParams(gen_length=16, answer_limit=bad)
    assert DecodingParams(gen_length=16, answer_limit=5).answer_budget == 5
    assert DecodingParams(gen_length=16).answer_budget == 16


def test_finish_reason_stop_without_early_exit() -> None:
    # EOS only at the last answer position: decoding runs to the end and reports "stop"
    gen = 8
    model = _eos_model(seed=5, position=len(PROMPT) + gen - 1)
    state, _ = _decode(_params(gen, 8, 8), model, stop_ids=STOPS)
    answer = state.canvas[len(PROMPT) :].tolist()
    assert state.finish_reason == "stop"
    assert state.answer_tokens() == truncate_at_stop(answer, STOPS)


def test_seeds() -> None:
    flat = MockLM(seed=6, scale=0.5)  # flat-ish logits: sampling really is random

    def canvas(temperature: float, seed) -> list[int]:
        return _decode(_params(32, 8, 16, temperature, seed), flat)[0].canvas.tolist()

    assert canvas(1.0, 42) == canvas(1.0, 42)
    assert canvas(1.0, 42) != canvas(1.0, 43)
    assert canvas(1.0, None) != canvas(1.0, None)  # fresh seeds (collision odds ~ 40**-32)
    assert canvas(1.0, -1) == canvas(1.0, 2**64 - 1)  # int64 seeds reduced modulo 2**64
    # The CPU generator keeps 32 bits of a seed: the high half is folded in, so seeds that
    # differ only there still differ (found by QA: 7 and 7 + 2**32 drew the same stream).
    assert canvas(1.0, 7) != canvas(1.0, 7 + 2**32)
    assert canvas(1.0, 7) != canvas(1.0, 7 + 2**63)
    greedy = canvas(0.0, 1)
    assert greedy == canvas(0.0, 2) == canvas(0.0, None)


def test_generator_only_when_sampling() -> None:
    denoiser = LLaDADenoiser(MASK_ID, STOPS)
    assert denoiser.init_state(PROMPT, _params(8, 8, 8, 0.0, 3), "cpu").generator is None
    assert denoiser.init_state(PROMPT, _params(8, 8, 8, 0.5, 3), "cpu").generator is not None


def test_interleaving_equals_running_alone() -> None:
    # Every parameter is per request: mixed temperatures, seeds, schedules, metrics, commit
    # modes, LocalLeap settings and block lengths, stepped round-robin, give each request
    # exactly what it gets alone.
    model = MockLM(seed=7, scale=4.0)
    denoiser = LLaDADenoiser(MASK_ID, STOPS)
    jobs = [
        ([4, 9, 12], _params(16, 4, 8, 1.0, seed=100)),
        ([21, 6], _params(12, 12, 6, 0.7, seed=100)),
        ([8, 8, 8, 8], _params(8, 4, 8, 0.0)),
        ([4, 9, 12], DecodingParams(16, 8, 8, 0.9, 100, block_schedule="cosine")),
        ([4, 9], DecodingParams(24, 4, 12, block_schedule="front_loaded")),
        ([3], DecodingParams(16, 16, 16, 1.2, 7, confidence_metric="entropy_inverse")),
        ([4, 9, 12], DecodingParams(16, 2, 8, 1.0, 100, confidence_threshold=0.6)),
        ([5, 5], DecodingParams(24, 8, 3, confidence_threshold=0.95)),
        ([4, 9, 12], DecodingParams(16, 4, 4, 0.8, 100, use_local_leap=True)),
        (
            [7, 1, 7],
            DecodingParams(
                20,
                5,
                4,
                confidence_metric="entropy_inverse",
                use_local_leap=True,
                local_leap_anchor_threshold=0.6,
                local_leap_neighbor_threshold=0.3,
                local_leap_radius=1,
            ),
        ),
    ]
    alone = []
    for prompt, params in jobs:
        state = denoiser.init_state(prompt, params, "cpu")
        run(denoiser, state, model)
        alone.append(state)
    states = [denoiser.init_state(prompt, params, "cpu") for prompt, params in jobs]
    while not all(s.finished for s in states):
        for s in states:
            if not s.finished:
                step(denoiser, s, model)
    for s, ref in zip(states, alone, strict=True):
        assert torch.equal(s.canvas, ref.canvas)
        assert (s.nfe, s.committed, s.finish_reason) == (ref.nfe, ref.committed, ref.finish_reason)
    assert len({s.nfe for s in states}) > 2  # the requests really ran for different lengths


def test_prepare_spec() -> None:
    denoiser = LLaDADenoiser(MASK_ID, STOPS)
    state = denoiser.init_state(PROMPT, _params(8, 4, 8), "cpu")
    step(denoiser, state, MockLM(seed=8))
    spec = denoiser.prepare(state)
    n = len(PROMPT) + 8
    assert spec.attention is AttentionKind.BIDIRECTIONAL
    assert torch.equal(spec.input_ids, state.canvas)
    assert torch.equal(spec.positions, torch.arange(n))
    assert spec.logits_index.tolist() == [
        i for i in range(len(PROMPT), len(PROMPT) + 4) if state.canvas[i] == MASK_ID
    ]
    assert len(spec.logits_index) == 3


def test_update_accepts_low_precision_and_does_not_mutate_logits() -> None:
    denoiser = LLaDADenoiser(MASK_ID, STOPS)
    state = denoiser.init_state(PROMPT, _params(8, 8, 4), "cpu")
    logits = MockLM(seed=9).forward(denoiser.prepare(state)).to(torch.bfloat16)
    original = logits.clone()
    assert denoiser.update(state, logits).committed == 2
    assert torch.equal(logits, original)


def test_errors() -> None:
    denoiser = LLaDADenoiser(MASK_ID, STOPS)
    with pytest.raises(ValueError):
        LLaDADenoiser(MASK_ID, (EOS_ID, MASK_ID))
    state = denoiser.init_state(PROMPT, _params(8, 8, 8), "cpu")
    with pytest.raises(ValueError):
        denoiser.update(state, torch.zeros(3, 40))  # 8 positions were asked for
    run(denoiser, state, MockLM(seed=10))
    with pytest.raises(RuntimeError):
        denoiser.prepare(state)
    with pytest.raises(RuntimeError):
        denoiser.update(state, torch.zeros(0, 40))


def _hand_built(answer: list[int]) -> DenoiseState:
    state = LLaDADenoiser(MASK_ID, STOPS).init_state([7, 7], _params(len(answer), 1, 8), "cpu")
    state.tokens[2:] = answer
    state.advance_final()  # what a commit does after writing tokens
    return state


M = MASK_ID


@pytest.mark.parametrize(
    ("answer", "final_len", "tokens"),
    [
        ([M] * 8, 0, []),
        ([1, 4, M, 5, M, M, M, M], 2, [1, 4]),
        ([1, 4, 5, 6, 7, 8, 9, 10], 8, [1, 4, 5, 6, 7, 8, 9, 10]),
        ([1, EOS_ID, M, M, M, M, M, M], 2, [1]),
        ([1, 9, 8, EOT_ID, 4, EOS_ID, M, M], 6, [1, 9, 8]),
        ([1, M, EOS_ID, 5, M, M, M, M], 1, [1]),  # a stop id after a mask is not final yet
        ([EOS_ID, 4, 5, 6, 7, 8, 9, 10], 8, []),
    ],
)
def test_answer_helpers(answer: list[int], final_len: int, tokens: list[int]) -> None:
    state = _hand_built(answer)
    assert state.final_len == final_len
    assert state.answer_tokens() == tokens
