"""ISD on a tiny I-DLM checkpoint: greedy == greedy AR, KV invariant, stops, forced drafts.

Every forward goes through the engine's ModelRunner (flat batch, K/V in a KV pool); the
reference greedy AR never touches the pool (full causal forwards of the padded model path).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
import torch

from dllm_serve.config import EngineConfig
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.decoding.protocol import AttentionKind, RowSpec
from dllm_serve.decoding.selfspec import ISDecoder, ISDState
from dllm_serve.engine.engine import AsyncEngine
from dllm_serve.engine.model_runner import ModelRunner
from dllm_serve.models.kv_pool import KVPages
from dllm_serve.models.loader import LoadedModel

PROMPTS = [[5, 17, 8, 30, 11], [101, 7], [42]]
STRIDES = [2, 3, 4, 8]
CPU = torch.device("cpu")
SLOTS = 256  # room for a request (≤ 41 slots) and a fresh prefill next to it


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


def new_runner(loaded: LoadedModel, slots: int = SLOTS) -> ModelRunner:
    return ModelRunner(loaded.model, CPU, kv_slots=slots)


def admit(runner: ModelRunner, decoder: ISDecoder, prompt: list[int], params) -> ISDState:
    """What the engine does at admission: the state, then its KV span."""
    assert runner.pool is not None
    state = decoder.init_state(prompt, params, "cpu")
    state.kv = runner.pool.reserve(decoder.kv_tokens(len(prompt), params))
    assert state.kv is not None
    return state


def run_isd(
    loaded: LoadedModel,
    decoder: ISDecoder,
    prompt: list[int],
    params: DecodingParams,
    after_round: Callable[[ISDState], None] | None = None,
    *,
    runner: ModelRunner | None = None,
    single: bool = False,
) -> ISDState:
    """Drive the decoder as the engine does (sample → one host copy → commit), one row per
    forward; ``single`` uses the one-row ``update`` instead. The span is freed at the end."""
    runner = runner or new_runner(loaded)
    assert runner.pool is not None
    state = admit(runner, decoder, prompt, params)
    span = state.kv
    with torch.inference_mode():
        while not state.finished:
            logits = runner.run([decoder.prepare(state)])
            if single:
                decoder.update(state, logits[0])
            else:
                decoder.commit([state], decoder.sample([state], logits).tolist())
            if after_round is not None:
                after_round(state)
    # The algorithm never frees K/V (the engine does, when the request ends).
    assert state.kv is span and span.reserved > 0
    runner.pool.free(span)
    assert runner.pool.reserved_pages == runner.pool.pages_used == 0
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
        decoder = ISDecoder(idlm.mask_id, idlm.stop_ids, stride=stride, draft_hook=hook)
        state = run_isd(idlm, decoder, prompt, DecodingParams(gen_length=20, steps=20))
        assert state.answer_tokens() == reference
        assert state.finish_reason == reason
        if drafts == "correct" and reason == "length":
            assert state.accepted_drafts == state.drafted > 0  # every branch V
        if drafts == "wrong":
            assert state.accepted_drafts == 0 and state.drafted > 0  # every branch R then C


def test_stride_one_is_plain_autoregressive(idlm: LoadedModel) -> None:
    decoder = ISDecoder(idlm.mask_id, idlm.stop_ids, stride=1)
    params = DecodingParams(gen_length=12, steps=12)
    state = run_isd(idlm, decoder, PROMPTS[0], params, single=True)
    assert state.answer_tokens() == greedy_ar(idlm, PROMPTS[0], 12)[0]
    assert state.drafted == 0 and state.nfe == state.committed


def span_kv(runner: ModelRunner, span: KVPages) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept K/V of ``span`` straight from the pool: ``[layers, length, Hkv, hd]``."""
    assert runner.pool is not None
    kept = span.slots(0, span.length)
    return runner.pool.k[:, kept].clone(), runner.pool.v[:, kept].clone()


def fresh_prefill(runner: ModelRunner, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of a causal prefill of ``ids`` into a span of its own (then freed)."""
    assert runner.pool is not None
    span = runner.pool.reserve(len(ids))
    assert span is not None
    row = RowSpec(ids, 0, [len(ids) - 1], AttentionKind.CAUSAL, kv=span)
    runner.run([row])
    span.length = len(ids)
    try:
        return span_kv(runner, span)
    finally:
        runner.pool.free(span)


@pytest.mark.parametrize("drafts", ["model", "correct", "wrong"])
def test_cache_equals_fresh_prefill_after_every_round(idlm: LoadedModel, drafts: str) -> None:
    prompt = PROMPTS[0]
    reference, _ = greedy_ar(idlm, prompt, 16)
    hook = None
    if drafts != "model":
        hook = forced(reference, idlm.model.config.vocab_size, idlm.mask_id, drafts == "correct")
    decoder = ISDecoder(idlm.mask_id, idlm.stop_ids, stride=4, draft_hook=hook)
    runner = new_runner(idlm)
    checked = 0

    def check(state: ISDState) -> None:
        nonlocal checked
        if state.finished:
            return
        span = state.kv
        assert span is not None
        assert span.length == len(prompt) + len(state.emitted) - 1  # §5.5
        keys, values = span_kv(runner, span)
        want_k, want_v = fresh_prefill(runner, prompt + state.emitted[:-1])
        assert keys.shape == want_k.shape
        assert (keys - want_k).abs().max() <= 1e-5
        assert (values - want_v).abs().max() <= 1e-5
        checked += 1

    state = run_isd(
        idlm, decoder, prompt, DecodingParams(gen_length=16, steps=16), check, runner=runner
    )
    assert checked > 1
    assert state.answer_tokens() == reference


def _with_stop(idlm: LoadedModel, stop_at: int, stride: int) -> tuple[list[int], ISDState]:
    """Make the ``stop_at``-th greedy token a stop id; oracle drafts so it lands mid-round."""
    prompt = PROMPTS[0]
    reference, _ = greedy_ar(idlm, prompt, 12)
    stop_token = reference[stop_at]
    stops = (*idlm.stop_ids, stop_token)
    hook = forced(reference, idlm.model.config.vocab_size, idlm.mask_id, correct=True)
    decoder = ISDecoder(idlm.mask_id, stops, stride=stride, draft_hook=hook)
    state = run_isd(idlm, decoder, prompt, DecodingParams(gen_length=12, steps=12))
    return reference, state


def test_stop_id_mid_round_drops_later_accepted_tokens(idlm: LoadedModel) -> None:
    reference, state = _with_stop(idlm, stop_at=5, stride=4)
    first = reference.index(reference[5])  # the stop token may occur earlier
    assert state.finish_reason == "stop"
    assert state.answer_tokens() == reference[:first]
    assert state.committed == first + 1  # the stop id counts, what follows it does not
    # Specs the verifier accepted after the stop id were never used: they are not counted.
    assert state.accepted_drafts <= state.committed - state.rounds + 1


@pytest.mark.parametrize("gen_length", [1, 5, 7])
def test_max_tokens_mid_round(idlm: LoadedModel, gen_length: int) -> None:
    reference, reason = greedy_ar(idlm, PROMPTS[0], gen_length)
    hook = forced(reference, idlm.model.config.vocab_size, idlm.mask_id, correct=True)
    decoder = ISDecoder(idlm.mask_id, idlm.stop_ids, stride=4, draft_hook=hook)
    params = DecodingParams(gen_length=gen_length, steps=gen_length)
    state = run_isd(idlm, decoder, PROMPTS[0], params, single=True)
    assert state.answer_tokens() == reference
    assert state.finish_reason == reason
    assert state.committed <= gen_length


def test_mixed_strides_phases_and_temperatures_share_forwards(idlm: LoadedModel) -> None:
    """Rows with different N, phases (prefill, cold start, verify) and T in one forward and one
    batched ``sample`` each; every row's answer equals its answer alone."""
    strides = [1, 2, 3, 4, 8, 3]
    jobs = []
    for i in range(len(strides)):
        temperature = [0.0, 0.05, 1.0][i % 3]
        params = DecodingParams(gen_length=10 + i, steps=10 + i, temperature=temperature, seed=i)
        jobs.append((PROMPTS[i % 3], params))
    alone = [
        run_isd(idlm, ISDecoder(idlm.mask_id, idlm.stop_ids, stride=n), p, q).answer_tokens()
        for n, (p, q) in zip(strides, jobs, strict=True)
    ]
    # One decoder for the whole batch; its stride follows the row being prepared.
    current = {"stride": 1}
    decoder = ISDecoder(
        idlm.mask_id, idlm.stop_ids, stride=1, stride_for=lambda: current["stride"], max_stride=8
    )
    runner = new_runner(idlm)
    assert runner.pool is not None
    states = [admit(runner, decoder, p, q) for p, q in jobs]
    stride_of = {id(s): n for s, n in zip(states, strides, strict=True)}
    shapes = set()
    with torch.inference_mode():
        while live := [s for s in states if not s.finished]:
            rows = []
            for s in live:
                current["stride"] = stride_of[id(s)]
                rows.append(decoder.prepare(s))
            shapes.add(tuple(s.round_shape for s in live))
            logits = runner.run(rows)
            decoder.commit(live, decoder.sample(live, logits).tolist())
    assert [s.answer_tokens() for s in states] == alone
    # Some forward mixed a prefill/cold start (K = 0) with a verify round (K > 0).
    assert any(len({k > 0 for k, _ in shape}) == 2 for shape in shapes)
    for s in states:
        runner.pool.free(s.kv)
    assert runner.pool.reserved_pages == runner.pool.pages_used == 0


def test_stride_changing_between_rounds_keeps_greedy_exact(idlm: LoadedModel) -> None:
    """Tiers can change N mid-request: leftover specs are truncated, the answer is unchanged."""
    prompt = PROMPTS[0]
    reference, _ = greedy_ar(idlm, prompt, 20)
    cycle = iter([4, 2, 8, 1, 3, 8, 2] * 10)
    # Always-correct drafts, so that truncated specs are ones that would have been accepted.
    hook = forced(reference, idlm.model.config.vocab_size, idlm.mask_id, correct=True)
    decoder = ISDecoder(
        idlm.mask_id, idlm.stop_ids, stride=4, stride_for=lambda: next(cycle),
        max_stride=8, draft_hook=hook,
    )  # fmt: skip
    state = run_isd(idlm, decoder, prompt, DecodingParams(gen_length=20, steps=20))
    assert state.answer_tokens() == reference


def test_sampled_drafts_keep_their_q_when_the_stride_changes(idlm: LoadedModel) -> None:
    cycle = iter([4, 2, 8, 1, 3, 8, 2] * 10)
    decoder = ISDecoder(
        idlm.mask_id, idlm.stop_ids, stride=4, stride_for=lambda: next(cycle), max_stride=8,
    )  # fmt: skip
    prompt = PROMPTS[1]

    def check(state: ISDState) -> None:
        if state.finished:
            return
        if state.specs:
            assert state.draft_q is not None and state.draft_q.shape[0] == len(state.specs)
        assert state.kv is not None
        assert state.kv.length == len(prompt) + len(state.emitted) - 1

    params = DecodingParams(gen_length=20, steps=20, temperature=0.1, seed=5)
    state = run_isd(idlm, decoder, prompt, params, check)
    assert state.drafted > state.accepted_drafts > 0  # both accept and reject paths ran


def test_engine_releases_the_kv_of_finished_isd_requests(idlm: LoadedModel) -> None:
    """Through the engine: greedy answers equal greedy AR, and every span goes back."""
    engine = AsyncEngine(idlm, EngineConfig(max_running_requests=3, kv_cache_memory=0.001))
    pool = engine.runner.pool
    assert pool is not None and engine.kv_cache_bytes == 0
    params = DecodingParams(gen_length=12, steps=12)

    async def one(prompt: list[int]) -> list:
        return [out async for out in engine.generate(prompt, params)]

    async def all_at_once() -> list[list]:
        return await asyncio.gather(*(one(p) for p in PROMPTS))

    engine.start()
    try:
        results = asyncio.run(all_at_once())
        assert pool.reserved_pages == pool.pages_used == 0 and engine.kv_cache_bytes == 0
        assert pool.free_pages == pool.num_pages
    finally:
        engine.shutdown()
    for prompt, outs in zip(PROMPTS, results, strict=True):
        assert outs[-1].finished and outs[-1].error is None
        reference, reason = greedy_ar(idlm, prompt, 12)
        assert outs[-1].finish_reason == reason
        assert "".join(o.delta_text for o in outs) == idlm.decode(reference)


# ---- suspected src bugs (failing on purpose; see the report) ------------------------------------


def test_isd_request_at_the_context_limit_completes(idlm: LoadedModel) -> None:
    """prompt + max tokens == the model's context (what the API admits). An ISD round puts
    its specs and MASKs after ``pending``, up to ``N − 2`` positions past the answer's last
    slot; those positions must still be valid rotary positions (the pre-v2 model computed
    RoPE from the positions, the v2 model indexes a table of ``max_sequence_length`` rows)."""
    limit = idlm.model.config.max_sequence_length
    assert idlm.max_length == limit
    gen = 8
    prompt = [5 + i % 50 for i in range(limit - gen)]
    params = DecodingParams(gen_length=gen, steps=gen)
    ar = ISDecoder(idlm.mask_id, idlm.stop_ids, stride=1)  # never past the answer
    reference = run_isd(idlm, ar, prompt, params, runner=new_runner(idlm, 2 * limit))
    hook = forced(reference.emitted, idlm.model.config.vocab_size, idlm.mask_id, correct=True)
    decoder = ISDecoder(idlm.mask_id, idlm.stop_ids, stride=4, draft_hook=hook)
    state = run_isd(idlm, decoder, prompt, params, runner=new_runner(idlm, 2 * limit))
    assert state.answer_tokens() == reference.answer_tokens()


def test_engine_pool_holds_one_request_at_the_context_limit(idlm: LoadedModel) -> None:
    """The engine sizes its pool for "every running request at the longest context" as
    ``max_running_requests × (max_length + 64)`` slots, but an ISD request reserves
    ``prompt + max tokens + 2 × max_stride``: with a stride above 32 a request the API admits
    (prompt + max tokens == max_length) can never be admitted, and is told to raise
    --kv-cache-memory, which cannot help."""
    engine = AsyncEngine(idlm, EngineConfig(max_running_requests=1, isd_stride=40))
    assert engine.runner.pool is not None
    params = DecodingParams(gen_length=48)
    need = engine.algorithm.kv_tokens(idlm.max_length - params.gen_length, params)
    assert need <= engine.runner.pool.slots


@pytest.mark.parametrize("stride", [1, 4, 8])
def test_scheduled_row_length_is_the_row_prepared(idlm: LoadedModel, stride: int) -> None:
    # Found by a code review: the prefill row was budgeted without its N − 1 masks, so a
    # forward of prefills could exceed --max-tokens-per-forward by N − 1 per row.
    decoder = ISDecoder(idlm.mask_id, idlm.stop_ids, stride=stride)
    runner = new_runner(idlm)
    assert runner.pool is not None
    params = DecodingParams(gen_length=18, steps=18, ignore_eos=True)
    state = admit(runner, decoder, PROMPTS[0], params)
    rounds = 0
    with torch.inference_mode():
        while not state.finished:
            budgeted = state.row_length
            row = decoder.prepare(state)
            assert budgeted == len(row.tokens), f"round {rounds}"
            decoder.commit([state], decoder.sample([state], runner.run([row])).tolist())
            rounds += 1
    assert rounds > 1
    runner.pool.free(state.kv)


def test_row_length_with_tiers_is_the_widest_row(idlm: LoadedModel) -> None:
    # The stride follows the load, so the budget is the widest stride's row.
    decoder = ISDecoder(idlm.mask_id, idlm.stop_ids, stride=2, max_stride=8)
    state = decoder.init_state(PROMPTS[0], DecodingParams(gen_length=18, steps=18), "cpu")
    assert state.row_length == len(PROMPTS[0]) + 8 - 1
