"""LinearSpec on a tiny Nemotron-format checkpoint: greedy == greedy AR token for token
(model, oracle, wrong and partly right drafts; block-size changes between rounds), the KV
span holds exactly the causal K/V of the committed prefix after every round, stops, and the
row shapes (draft rows bidirectional in the draft weight view, verify rows causal).

A random model's drafts are almost never accepted, so the acceptance paths are driven by
replacing the drafts after the draft forward (the verify does not know where they came from).
"""

from __future__ import annotations

import pytest
import torch
from trimode_support import CPU, admit, assert_cache_is_causal, drive, greedy_ar

from dllm_serve.decoding.linear_spec import DRAFT, VERIFY, LinearSpecDecoder, LinearSpecState
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.decoding.protocol import AttentionKind
from dllm_serve.decoding.selfspec import ISDecoder
from dllm_serve.engine.model_runner import ModelRunner
from dllm_serve.models.loader import LoadedModel

PROMPTS = [[201, 305, 150, 420, 133], [512, 140], [777]]
pytestmark = pytest.mark.usefixtures("one_thread")


def run(
    loaded: LoadedModel,
    decoder,
    prompt: list[int],
    gen_length: int,
    drafts=None,
    check=None,
    runner: ModelRunner | None = None,
) -> LinearSpecState:
    """One request to the end; ``drafts(state)`` replaces each round's drafts; ``check(state)``
    runs after every verify."""
    runner = runner or ModelRunner(loaded.model, CPU, kv_slots=256)
    params = DecodingParams(gen_length=gen_length, steps=gen_length)
    state = admit(runner, decoder, prompt, params)

    def after(s, phase: str) -> None:
        if phase == DRAFT and drafts is not None and s.phase == VERIFY:
            s.specs = drafts(s)
        if phase in ("prefill", VERIFY) and check is not None and not s.finished:
            check(s)

    drive(runner, decoder, [state], after)
    assert runner.pool is not None
    runner.pool.free(state.kv)
    return state


def oracle(reference: list[int], vocab: int, right: int | None = None):
    """Drafts that continue the reference (the first ``right`` of them only, then wrong)."""

    def drafts(state: LinearSpecState) -> list[int]:
        at = len(state.emitted)  # drafts are for the slots after the seed
        out = []
        for j in range(len(state.specs)):
            ref = reference[at + j] if at + j < len(reference) else 130
            good = right is None or j < right
            out.append(ref if good else 128 + (ref - 127) % (vocab - 129))
        return out

    return drafts


@pytest.mark.parametrize("block", [2, 4, 8])
def test_greedy_linear_spec_equals_greedy_ar(nemotron: LoadedModel, block: int) -> None:
    for prompt in PROMPTS:
        reference, reason = greedy_ar(nemotron, prompt, 18)
        decoder = LinearSpecDecoder(nemotron.mask_id, nemotron.stop_ids, block_size=block)
        state = run(nemotron, decoder, prompt, 18)
        assert (state.answer_tokens(), state.finish_reason) == (reference, reason)
        # One prefill, then a draft and a verify per round (a one-token round skips its draft).
        assert 1 + state.rounds <= state.nfe <= 1 + 2 * state.rounds


def test_ar_mode_is_plain_autoregressive(nemotron: LoadedModel) -> None:
    decoder = ISDecoder(nemotron.mask_id, nemotron.stop_ids, stride=1)
    runner = ModelRunner(nemotron.model, CPU, kv_slots=256)
    state = admit(runner, decoder, PROMPTS[0], DecodingParams(gen_length=12, steps=12))
    drive(runner, decoder, [state])
    assert state.answer_tokens() == greedy_ar(nemotron, PROMPTS[0], 12)[0]
    assert state.nfe == state.committed == 12 and state.drafted == 0


@pytest.mark.parametrize("right", [None, 0, 3])
def test_forced_drafts_keep_the_answer_and_the_cache_exact(
    nemotron: LoadedModel, right: int | None
) -> None:
    """All-right, all-wrong and right-then-wrong drafts: the same answer as greedy AR, exact
    accounting, and after every verify the span holds the causal K/V of prompt + emitted[:-1]."""
    prompt = PROMPTS[0]
    reference, _ = greedy_ar(nemotron, prompt, 20)
    runner = ModelRunner(nemotron.model, CPU, kv_slots=256)
    decoder = LinearSpecDecoder(nemotron.mask_id, nemotron.stop_ids, block_size=6)
    checked = 0

    def check(state: LinearSpecState) -> None:
        nonlocal checked
        assert state.kv is not None
        assert state.kv.length == len(prompt) + state.generated - 1
        assert_cache_is_causal(runner, state.kv, prompt + state.emitted[:-1])
        checked += 1

    forced = oracle(reference, nemotron.vocab_size, right)
    expected = 0

    def drafts(state: LinearSpecState) -> list[int]:
        nonlocal expected
        out = forced(state)
        expected += len(out) if right is None else min(right, len(out))
        return out

    state = run(nemotron, decoder, prompt, 20, drafts, check, runner)
    assert state.answer_tokens() == reference
    assert checked == state.rounds  # after the prefill and every verify but the last
    assert state.accepted_drafts == expected and state.drafted > 0
    if right is None:  # every draft accepted: full rounds of 6 tokens, then one AR step
        assert state.rounds == 4 and state.nfe == 1 + 2 * 3 + 1  # 1 + 6 + 6 + 6 + 1 tokens


def test_stop_inside_an_accepted_run_drops_what_follows(nemotron: LoadedModel) -> None:
    prompt = PROMPTS[0]
    reference, _ = greedy_ar(nemotron, prompt, 12)
    stop = reference[5]
    first = reference.index(stop)
    decoder = LinearSpecDecoder(nemotron.mask_id, (*nemotron.stop_ids, stop), block_size=8)
    state = run(nemotron, decoder, prompt, 12, oracle(reference, nemotron.vocab_size))
    assert state.finish_reason == "stop"
    assert state.answer_tokens() == reference[:first]
    assert state.committed == first + 1  # the stop id counts, what follows it does not
    # Every token after the prefill's was an accepted draft of the first round; the drafts
    # that round accepted after the stop id are not counted (the answer never used them).
    assert state.rounds == 1 and state.drafted == 7
    assert state.accepted_drafts == state.committed - 1 == first


@pytest.mark.parametrize("gen_length", [1, 2, 7, 9])
def test_max_tokens_mid_round(nemotron: LoadedModel, gen_length: int) -> None:
    reference, reason = greedy_ar(nemotron, PROMPTS[1], gen_length)
    decoder = LinearSpecDecoder(nemotron.mask_id, nemotron.stop_ids, block_size=4)
    state = run(nemotron, decoder, PROMPTS[1], gen_length, oracle(reference, 896))
    assert (state.answer_tokens(), state.finish_reason) == (reference, reason)
    assert state.committed == state.generated <= gen_length
    assert state.accepted_drafts <= state.committed  # none past max tokens


def test_block_tiers_may_change_the_block_between_rounds(nemotron: LoadedModel) -> None:
    widths = iter([8, 3, 1, 5, 2] * 10)
    decoder = LinearSpecDecoder(
        nemotron.mask_id, nemotron.stop_ids, block_size=8, block_for=lambda: next(widths),
        max_block=8,
    )  # fmt: skip
    reference, _ = greedy_ar(nemotron, PROMPTS[0], 16)
    state = run(nemotron, decoder, PROMPTS[0], 16, oracle(reference, 896, right=2))
    assert state.answer_tokens() == reference


def test_rows_draft_bidirectionally_in_the_draft_view_and_verify_causally(
    nemotron: LoadedModel,
) -> None:
    decoder = LinearSpecDecoder(nemotron.mask_id, nemotron.stop_ids, block_size=4)
    runner = ModelRunner(nemotron.model, CPU, kv_slots=64)
    state = admit(runner, decoder, PROMPTS[0], DecodingParams(gen_length=8, steps=8))
    prefill = decoder.prepare(state)
    assert (prefill.attention, prefill.draft, prefill.logits_at) == (AttentionKind.CAUSAL,
                                                                     False, [4])  # fmt: skip
    with torch.inference_mode():
        decoder.commit([state], decoder.sample([state], runner.run([prefill])).tolist())
        draft = decoder.prepare(state)
        assert draft.attention is AttentionKind.BIDIRECTIONAL and draft.draft
        assert draft.tokens == [state.seed] + [nemotron.mask_id] * 3 and draft.start == 5
        assert draft.logits_at == [1, 2, 3]  # the diffusion view: logits at i predict i
        decoder.commit([state], decoder.sample([state], runner.run([draft])).tolist())
    verify = decoder.prepare(state)
    assert verify.attention is AttentionKind.CAUSAL and not verify.draft
    assert verify.tokens == [state.seed, *state.specs] and verify.logits_at == [0, 1, 2, 3]
    assert nemotron.mask_id not in state.specs


@pytest.mark.parametrize("gen_length", [3, 16])
def test_scheduled_row_length_is_the_row_prepared(nemotron: LoadedModel, gen_length: int) -> None:
    # Found by a code review: a draft row was budgeted at the previous round's width (1 after
    # the prefill), so the scheduler under-counted it by up to B − 1 tokens.
    decoder = LinearSpecDecoder(nemotron.mask_id, nemotron.stop_ids, block_size=4)
    runner = ModelRunner(nemotron.model, CPU, kv_slots=256)
    params = DecodingParams(gen_length=gen_length, steps=gen_length, ignore_eos=True)
    state = admit(runner, decoder, PROMPTS[0], params)
    forwards = 0
    with torch.inference_mode():
        while not state.finished:
            budgeted = state.row_length
            row = decoder.prepare(state)
            assert budgeted == len(row.tokens), f"forward {forwards} ({state.phase})"
            decoder.commit([state], decoder.sample([state], runner.run([row])).tolist())
            forwards += 1
    assert forwards > 2
    assert runner.pool is not None
    runner.pool.free(state.kv)
