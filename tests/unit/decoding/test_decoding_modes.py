"""Threshold (Fast-dLLM) and LocalLeap modes, schedules and metrics, end to end (§2.4, §7)."""

from __future__ import annotations

import pytest
import torch
from decoding_mock import EOS_ID, EOT_ID, MASK_ID, MockLM, ScriptedLM, StepRecord, decode
from one_row_rules import local_leap_commit, threshold_commit, topk_commit

from dllm_serve.decoding.commit_rules import block_schedule
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.decoding.sampler import confidence

PROMPT = [5, 17, 8, 30, 11]
P = len(PROMPT)
STOPS = (EOS_ID, EOT_ID)
CONFIGS = [(16, 16), (16, 4), (24, 8), (12, 1)]  # (gen_length, block_length)
MODES = {
    "threshold": {"confidence_threshold": 0.9},
    "threshold-low": {"confidence_threshold": 0.5},
    "local_leap": {"use_local_leap": True},
    "local_leap-wide": {
        "use_local_leap": True,
        "local_leap_anchor_threshold": 0.8,
        "local_leap_neighbor_threshold": 0.4,
        "local_leap_radius": 8,
    },
}


def _params(gen: int, block: int, mode: dict, **kw) -> DecodingParams:
    return DecodingParams(gen_length=gen, block_length=block, steps=gen // block, **mode, **kw)


def _expected_commit(model: MockLM, rec: StepRecord, params: DecodingParams) -> torch.Tensor:
    """The rule's set, recomputed from scratch at T = 0 (independent of the denoiser)."""
    index = rec.logits_index
    z = model(rec.before)[index].double()
    z[:, MASK_ID] = -float("inf")
    score = confidence(params.confidence_metric, z, z.argmax(-1))
    if params.mode == "threshold":
        commit = threshold_commit(score, params.confidence_threshold)
    elif params.mode == "local_leap":
        commit = local_leap_commit(
            score,
            index,
            params.local_leap_anchor_threshold,
            params.local_leap_neighbor_threshold,
            params.local_leap_radius,
        )
    else:
        commit = topk_commit(score, rec.scheduled)
    return index[commit]


def _check_common(state, records: list[StepRecord], params: DecodingParams) -> None:
    """Monotonicity, locality, progress, block order, termination, counters (§7)."""
    prompt = torch.tensor(PROMPT)
    per_block: dict[int, int] = {}
    for rec in records:
        changed = torch.nonzero(rec.before != rec.after).squeeze(1)
        assert changed.numel() == rec.result.committed >= 1
        assert torch.all((changed >= rec.lo) & (changed < rec.hi))
        assert torch.all(rec.before[changed] == MASK_ID)
        assert torch.all(rec.after[changed] != MASK_ID)
        kept = rec.before != MASK_ID
        assert torch.equal(rec.after[kept], rec.before[kept])
        assert torch.equal(rec.after[:P], prompt)
        assert torch.all(rec.before[P : rec.lo] != MASK_ID)
        assert torch.all(rec.after[rec.hi :] == MASK_ID)
        expected = torch.nonzero(rec.before[rec.lo : rec.hi] == MASK_ID).squeeze(1) + rec.lo
        assert torch.equal(rec.logits_index, expected)
        per_block[rec.block] = per_block.get(rec.block, 0) + 1
    assert all(n <= params.block_length for n in per_block.values())
    assert state.nfe == len(records) <= params.gen_length
    assert state.committed == sum(r.result.committed for r in records)
    assert state.tokens_per_forward == state.committed / state.nfe


@pytest.mark.parametrize("metric", ["top1_prob", "entropy_inverse"])
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize(("gen", "block"), CONFIGS)
def test_data_dependent_modes_commit_exactly_their_rule(gen, block, mode, metric) -> None:
    model = MockLM(seed=11, scale=7.0)
    params = _params(gen, block, MODES[mode], confidence_metric=metric)
    state, records = decode(params, model)
    _check_common(state, records, params)
    for rec in records:
        changed = torch.nonzero(rec.before != rec.after).squeeze(1)
        assert torch.equal(changed, _expected_commit(model, rec, params))
        assert rec.scheduled is None
    assert not torch.any(state.canvas == MASK_ID)
    assert state.committed == gen and state.finish_reason == "length"


@pytest.mark.parametrize("mode", sorted(MODES))
def test_sampling_invariants_and_seeds(mode: str) -> None:
    model = MockLM(seed=12, scale=4.0)
    params = _params(24, 8, MODES[mode], temperature=0.9, seed=5)
    state, records = decode(params, model)
    _check_common(state, records, params)
    again, _ = decode(params, model)
    assert torch.equal(state.canvas, again.canvas) and state.nfe == again.nfe
    other, _ = decode(_params(24, 8, MODES[mode], temperature=0.9, seed=6), model)
    assert not torch.equal(state.canvas, other.canvas)
    greedy = [decode(_params(24, 8, MODES[mode], seed=s), model)[0].canvas for s in (1, 2)]
    assert torch.equal(*greedy)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_mask_id_never_committed(mode: str) -> None:
    model = MockLM(seed=2, scale=7.0, mask_logit=60.0)  # the model's favourite is the mask
    for temperature in (0.0, 1.0):
        state, records = decode(_params(16, 4, MODES[mode], temperature=temperature, seed=1), model)
        _check_common(state, records, _params(16, 4, MODES[mode]))
        assert not torch.any(state.canvas == MASK_ID)


def test_unconfident_model_takes_one_forward_per_token() -> None:
    # nothing reaches κ or the threshold: both modes degenerate to one commit per step,
    # the termination bound (b forwards per block) is reached exactly
    flat = MockLM(seed=3, scale=0.3)
    for mode in ("threshold", "local_leap"):
        state, records = decode(_params(16, 4, MODES[mode]), flat)
        assert [r.result.committed for r in records] == [1] * 16
        assert state.nfe == 16 and state.tokens_per_forward == 1.0


def test_confident_model_saves_forwards() -> None:
    model = MockLM(seed=4, scale=12.0)
    base, _ = decode(DecodingParams(gen_length=32, block_length=8, steps=32), model)
    for mode in ("threshold", "threshold-low", "local_leap", "local_leap-wide"):
        state, _ = decode(_params(32, 8, MODES[mode]), model)
        assert state.nfe < base.nfe == 32
        assert state.tokens_per_forward > 1.0


@pytest.mark.parametrize(("gen", "block"), CONFIGS)
def test_local_leap_degenerates_to_threshold(gen: int, block: int) -> None:
    # §2.4 property 5, end to end: W = 0 or τ = κ is threshold decoding at κ
    model = MockLM(seed=13, scale=7.0)
    ref, _ = decode(_params(gen, block, {"confidence_threshold": 0.8}), model)
    for extra in ({"local_leap_radius": 0}, {"local_leap_neighbor_threshold": 0.8}):
        leap = {"use_local_leap": True, "local_leap_anchor_threshold": 0.8, **extra}
        state, _ = decode(_params(gen, block, leap), model)
        assert torch.equal(state.canvas, ref.canvas) and state.nfe == ref.nfe


def test_committed_tokens_are_never_anchors() -> None:
    lo = P
    script = [
        {lo: (20, 0.99)},  # step 1: lo is an anchor (and the argmax); nothing else qualifies
        # step 2: lo is committed. lo+1 and lo+2 are within W of it and reach τ but not κ:
        # only the argmax (lo+2) may commit, as nothing masked reaches κ in this step
        {lo + 1: (21, 0.8), lo + 2: (22, 0.85)},
        {},
    ]
    params = _params(8, 8, MODES["local_leap"])
    state, records = decode(params, ScriptedLM(script))
    assert [r.result.committed for r in records[:2]] == [1, 1]
    assert state.canvas[lo].item() == 20 and state.canvas[lo + 2].item() == 22
    assert records[1].after[lo + 1].item() == MASK_ID


def test_one_step_of_propagation_end_to_end() -> None:
    lo = P
    script = [{lo: (20, 0.95), lo + 2: (21, 0.8), lo + 5: (22, 0.8)}, {}]
    params = _params(8, 8, {**MODES["local_leap"], "local_leap_radius": 3})
    _, records = decode(params, ScriptedLM(script))
    first = torch.nonzero(records[0].before != records[0].after).squeeze(1).tolist()
    assert first == [lo, lo + 2]  # lo+5 is 3 from lo+2 but 5 from the anchor


@pytest.mark.parametrize("schedule", ["uniform", "cosine", "front_loaded"])
@pytest.mark.parametrize("metric", ["top1_prob", "entropy_inverse"])
@pytest.mark.parametrize(("gen", "block", "steps"), [(16, 16, 8), (24, 8, 12), (32, 8, 16)])
def test_schedules_end_to_end(schedule, metric, gen, block, steps) -> None:
    model = MockLM(seed=14)
    params = DecodingParams(
        gen_length=gen, block_length=block, steps=steps, block_schedule=schedule,
        confidence_metric=metric,
    )  # fmt: skip
    state, records = decode(params, model)
    _check_common(state, records, params)
    expected = block_schedule(schedule, block, params.steps_per_block)
    for k in range(params.num_blocks):
        assert [r.result.committed for r in records if r.block == k] == expected
    for rec in records:
        changed = torch.nonzero(rec.before != rec.after).squeeze(1)
        assert torch.equal(changed, _expected_commit(model, rec, params))
    assert state.nfe == steps and state.committed == gen


def test_metric_changes_the_order_of_commits() -> None:
    model = MockLM(seed=15)
    runs = {
        metric: decode(DecodingParams(16, 16, 16, confidence_metric=metric), model)[1]
        for metric in ("top1_prob", "entropy_inverse")
    }
    order = {
        metric: [int(torch.nonzero(r.before != r.after)) for r in recs]
        for metric, recs in runs.items()
    }
    assert order["top1_prob"] != order["entropy_inverse"]


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_early_stop_is_exact_in_every_mode(mode: str, temperature: float) -> None:
    model = MockLM(seed=4, scale=5.0)
    model.bias[P + 3, EOS_ID] = 30.0
    model.bias[:, EOT_ID] = -30.0
    params = _params(24, 4, MODES[mode], temperature=temperature, seed=3)
    early, _ = decode(params, model, stop_ids=STOPS)
    full, _ = decode(params, model, stop_ids=())
    assert early.finish_reason == "stop" and full.finish_reason == "length"
    assert early.nfe < full.nfe
    answer = full.canvas[P:].tolist()
    cut = answer[: answer.index(EOS_ID)] if EOS_ID in answer else answer
    assert early.answer_tokens() == [t for t in cut if t not in STOPS] == cut
    done = early.canvas != MASK_ID
    assert torch.equal(early.canvas[done], full.canvas[done])


def test_mode_selection() -> None:
    assert DecodingParams().mode == "topk"
    assert DecodingParams(confidence_threshold=0.9).mode == "threshold"
    assert DecodingParams(use_local_leap=True).mode == "local_leap"
    for bad in (
        {"confidence_threshold": 0.0},
        {"confidence_threshold": 1.5},
        {"use_local_leap": True, "confidence_threshold": 0.9},
        {"local_leap_anchor_threshold": 0.7},  # default τ 0.75 > κ
        {"local_leap_anchor_threshold": 1.2, "local_leap_neighbor_threshold": 0.5},
        {"local_leap_neighbor_threshold": -0.1},
        {"local_leap_radius": -1},
        {"use_local_leap": True, "block_schedule": "cosine"},
        {"confidence_threshold": 0.9, "block_schedule": "front_loaded"},
        {"block_schedule": "linear"},
        {"confidence_metric": "margin"},
    ):
        with pytest.raises(ValueError):
            DecodingParams(**bad)
    assert DecodingParams(confidence_threshold=1.0).confidence_threshold == 1.0
    # steps must still be a multiple of the block count in the data-dependent modes
    with pytest.raises(ValueError):
        DecodingParams(gen_length=16, block_length=4, steps=6, use_local_leap=True)
