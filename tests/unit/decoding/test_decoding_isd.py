"""ISD on a tiny I-DLM checkpoint: greedy == greedy AR, KV invariant, stops, forced drafts."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from dllm_serve.decoding.isd import ISDecoder, ISDState
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.engine.batch import build_batch, run_batch
from dllm_serve.models.kv_cache import KVBatch, KVCache
from dllm_serve.models.loader import LoadedModel

PROMPTS = [[5, 17, 8, 30, 11], [101, 7], [42]]
STRIDES = [2, 3, 4, 8]


pytestmark = pytest.mark.usefixtures("one_thread")


def causal_hidden(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """Full causal forward of ``ids`` without any cache (the reference computation)."""
    x = torch.tensor([ids])
    n = len(ids)
    mask = torch.tril(torch.ones(n, n, dtype=torch.bool))[None, None]
    return model(x, torch.arange(n)[None], mask)[0]


_AR: dict[tuple[int, tuple[int, ...], int], tuple[list[int], str]] = {}


def greedy_ar(loaded: LoadedModel, prompt: list[int], gen_length: int) -> tuple[list[int], str]:
    """Independent greedy AR: one full causal forward per token, mask id excluded (memoised)."""
    key = (id(loaded), tuple(prompt), gen_length)
    if key not in _AR:
        _AR[key] = _greedy_ar(loaded, prompt, gen_length)
    answer, reason = _AR[key]
    return list(answer), reason


def _greedy_ar(loaded: LoadedModel, prompt: list[int], gen_length: int) -> tuple[list[int], str]:
    ids, answer = list(prompt), []
    with torch.inference_mode():
        for _ in range(gen_length):
            z = loaded.model.lm_head(causal_hidden(loaded.model, ids)[-1]).double()
            z[loaded.mask_id] = float("-inf")
            token = int(z.argmax())
            if token in loaded.stop_ids:
                return answer, "stop"
            answer.append(token)
            ids.append(token)
    return answer, "length"


def run_isd(
    loaded: LoadedModel,
    decoder: ISDecoder,
    prompt: list[int],
    params: DecodingParams,
    after_round: Callable[[ISDState], None] | None = None,
) -> ISDState:
    """Drive the decoder exactly as the engine does, one row per forward."""
    state = decoder.init_state(prompt, params, "cpu")
    with torch.inference_mode():
        while not state.finished:
            batch = build_batch([decoder.prepare(state)], pad_id=loaded.mask_id)
            decoder.update(state, run_batch(loaded.model, batch)[0])
            if after_round is not None:
                after_round(state)
    return state


def forced(reference: list[int], vocab: int, mask_id: int, correct: bool):
    """A draft hook that proposes the reference continuation (or a token that differs)."""

    def hook(state: ISDState, drafts: list[int]) -> list[int]:
        at = len(state.emitted)  # the drafts are for the slots after the new pending token
        out = []
        for j in range(len(drafts)):
            ref = reference[at + j] if at + j < len(reference) else 3
            token = ref if correct else (ref + 1) % vocab
            out.append(token if token != mask_id else (token + 1) % vocab)
        return out

    return hook


@pytest.mark.parametrize("stride", STRIDES)
@pytest.mark.parametrize("drafts", ["model", "correct", "wrong"])
def test_greedy_isd_equals_greedy_ar(idlm: LoadedModel, stride: int, drafts: str) -> None:
    vocab = idlm.model.config.vocab_size
    for prompt in PROMPTS if drafts == "model" else PROMPTS[:2]:
        reference, reason = greedy_ar(idlm, prompt, 20)
        hook = None
        if drafts != "model":
            hook = forced(reference, vocab, idlm.mask_id, correct=drafts == "correct")
        decoder = ISDecoder(idlm.model, idlm.mask_id, idlm.stop_ids, stride=stride, draft_hook=hook)
        state = run_isd(idlm, decoder, prompt, DecodingParams(gen_length=20, steps=20))
        assert state.answer_tokens() == reference
        assert state.finish_reason == reason
        if drafts == "correct" and reason == "length":
            assert state.accepted_drafts == state.drafted > 0  # every branch V
        if drafts == "wrong":
            assert state.accepted_drafts == 0 and state.drafted > 0  # every branch R then C


def test_stride_one_is_plain_autoregressive(idlm: LoadedModel) -> None:
    decoder = ISDecoder(idlm.model, idlm.mask_id, idlm.stop_ids, stride=1)
    state = run_isd(idlm, decoder, PROMPTS[0], DecodingParams(gen_length=12, steps=12))
    assert state.answer_tokens() == greedy_ar(idlm, PROMPTS[0], 12)[0]
    assert state.drafted == 0 and state.nfe == state.committed


def fresh_prefill(model: torch.nn.Module, ids: list[int]) -> KVCache:
    cache = KVCache.for_model(model)
    n = len(ids)
    mask = torch.tril(torch.ones(n, n, dtype=torch.bool))[None, None]
    with torch.inference_mode():
        batch = KVBatch([cache], write=n)
        model(torch.tensor([ids]), torch.arange(n)[None], mask, kv_cache=batch)
    return cache


@pytest.mark.parametrize("drafts", ["model", "correct", "wrong"])
def test_cache_equals_fresh_prefill_after_every_round(idlm: LoadedModel, drafts: str) -> None:
    prompt = PROMPTS[0]
    reference, _ = greedy_ar(idlm, prompt, 16)
    hook = None
    if drafts != "model":
        hook = forced(reference, idlm.model.config.vocab_size, idlm.mask_id, drafts == "correct")
    decoder = ISDecoder(idlm.model, idlm.mask_id, idlm.stop_ids, stride=4, draft_hook=hook)
    checked = 0

    def check(state: ISDState) -> None:
        nonlocal checked
        if state.finished:
            assert state.cache is None  # released at once
            return
        cache = state.cache
        assert cache is not None
        assert cache.length == len(prompt) + len(state.emitted) - 1  # §5.5
        expected = fresh_prefill(idlm.model, prompt + state.emitted[:-1])
        assert (cache.keys - expected.keys).abs().max() <= 1e-5
        assert (cache.values - expected.values).abs().max() <= 1e-5
        checked += 1

    run_isd(idlm, decoder, prompt, DecodingParams(gen_length=16, steps=16), check)
    assert checked > 1


def _with_stop(idlm: LoadedModel, stop_at: int, stride: int) -> tuple[list[int], ISDState]:
    """Make the ``stop_at``-th greedy token a stop id; oracle drafts so it lands mid-round."""
    prompt = PROMPTS[0]
    reference, _ = greedy_ar(idlm, prompt, 12)
    stop_token = reference[stop_at]
    stops = (*idlm.stop_ids, stop_token)
    hook = forced(reference, idlm.model.config.vocab_size, idlm.mask_id, correct=True)
    decoder = ISDecoder(idlm.model, idlm.mask_id, stops, stride=stride, draft_hook=hook)
    state = run_isd(idlm, decoder, prompt, DecodingParams(gen_length=12, steps=12))
    return reference, state


def test_stop_id_mid_round_drops_later_accepted_tokens(idlm: LoadedModel) -> None:
    reference, state = _with_stop(idlm, stop_at=5, stride=4)
    first = reference.index(reference[5])  # the stop token may occur earlier
    assert state.finish_reason == "stop"
    assert state.answer_tokens() == reference[:first]
    assert state.committed == first + 1  # the stop id counts, what follows it does not


@pytest.mark.parametrize("gen_length", [1, 5, 7])
def test_max_tokens_mid_round(idlm: LoadedModel, gen_length: int) -> None:
    reference, reason = greedy_ar(idlm, PROMPTS[0], gen_length)
    hook = forced(reference, idlm.model.config.vocab_size, idlm.mask_id, correct=True)
    decoder = ISDecoder(idlm.model, idlm.mask_id, idlm.stop_ids, stride=4, draft_hook=hook)
    params = DecodingParams(gen_length=gen_length, steps=gen_length)
    state = run_isd(idlm, decoder, PROMPTS[0], params)
    assert state.answer_tokens() == reference
    assert state.finish_reason == reason
    assert state.committed <= gen_length


def test_mixed_strides_phases_and_temperatures_share_forwards(idlm: LoadedModel) -> None:
    """Rows with different N, phases (prefill, cold start, verify) and T in one forward each."""
    rows = []
    for i, stride in enumerate([1, 2, 3, 4, 8, 3]):
        decoder = ISDecoder(idlm.model, idlm.mask_id, idlm.stop_ids, stride=stride)
        temperature = [0.0, 0.05, 1.0][i % 3]
        params = DecodingParams(gen_length=10 + i, steps=10 + i, temperature=temperature, seed=i)
        rows.append((decoder, PROMPTS[i % 3], params))
    alone = [run_isd(idlm, d, p, q).answer_tokens() for d, p, q in rows]
    states = [d.init_state(p, q, "cpu") for d, p, q in rows]
    with torch.inference_mode():
        while live := [(d, s) for (d, _, _), s in zip(rows, states, strict=True) if not s.finished]:
            batch = build_batch([d.prepare(s) for d, s in live], pad_id=idlm.mask_id)
            for (d, s), logits in zip(live, run_batch(idlm.model, batch), strict=True):
                d.update(s, logits)
    assert [s.answer_tokens() for s in states] == alone


def test_stride_changing_between_rounds_keeps_greedy_exact(idlm: LoadedModel) -> None:
    """Tiers can change N mid-request: leftover specs are truncated, the answer is unchanged."""
    prompt = PROMPTS[0]
    reference, _ = greedy_ar(idlm, prompt, 20)
    cycle = iter([4, 2, 8, 1, 3, 8, 2] * 10)
    # Always-correct drafts, so that truncated specs are ones that would have been accepted.
    hook = forced(reference, idlm.model.config.vocab_size, idlm.mask_id, correct=True)
    decoder = ISDecoder(
        idlm.model, idlm.mask_id, idlm.stop_ids, stride=4, stride_for=lambda: next(cycle),
        max_stride=8, draft_hook=hook,
    )  # fmt: skip
    state = run_isd(idlm, decoder, prompt, DecodingParams(gen_length=20, steps=20))
    assert state.answer_tokens() == reference


def test_sampled_drafts_keep_their_q_when_the_stride_changes(idlm: LoadedModel) -> None:
    cycle = iter([4, 2, 8, 1, 3, 8, 2] * 10)
    decoder = ISDecoder(
        idlm.model, idlm.mask_id, idlm.stop_ids, stride=4, stride_for=lambda: next(cycle),
        max_stride=8,
    )  # fmt: skip
    prompt = PROMPTS[1]

    def check(state: ISDState) -> None:
        if state.finished:
            return
        if state.specs:
            assert state.draft_q is not None and state.draft_q.shape[0] == len(state.specs)
        assert state.cache is not None
        assert state.cache.length == len(prompt) + len(state.emitted) - 1

    params = DecodingParams(gen_length=20, steps=20, temperature=0.1, seed=5)
    state = run_isd(idlm, decoder, prompt, params, check)
    assert state.drafted > state.accepted_drafts > 0  # both accept and reject paths ran
