"""Helpers of the tri-mode decoding tests: an independent greedy AR reference and a driver
that runs decoders through the engine's ModelRunner as the engine does."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from dllm_serve.decoding.protocol import AttentionKind, RowSpec
from dllm_serve.engine.model_runner import ModelRunner
from dllm_serve.models.kv_pool import KVPages
from dllm_serve.models.loader import LoadedModel

CPU = torch.device("cpu")


def causal_logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    """Logits ``[L, V]`` of one full causal forward of ``ids`` (padded path, no cache)."""
    n = len(ids)
    mask = torch.tril(torch.ones(n, n, dtype=torch.bool))[None, None]
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor([ids]), torch.arange(n)[None], mask)[0]
        return loaded.model.lm_head(hidden)


def greedy_ar(
    loaded: LoadedModel, prompt: list[int], gen_length: int, stops: Sequence[int] | None = None
) -> tuple[list[int], str]:
    """Independent greedy AR: one full causal forward per token, mask id excluded."""
    stops = loaded.stop_ids if stops is None else stops
    ids, answer = list(prompt), []
    for _ in range(gen_length):
        z = causal_logits(loaded, ids)[-1].double()
        z[loaded.mask_id] = float("-inf")
        token = int(z.argmax())
        if token in stops:
            return answer, "stop"
        answer.append(token)
        ids.append(token)
    return answer, "length"


def admit(runner: ModelRunner, decoder: Any, prompt: list[int], params: Any) -> Any:
    """What the engine does at admission: the state, then its KV span."""
    assert runner.pool is not None
    state = decoder.init_state(prompt, params, "cpu")
    state.kv = runner.pool.reserve(decoder.kv_tokens(len(prompt), params))
    assert state.kv is not None
    return state


def drive(
    runner: ModelRunner,
    decoder: Any,
    states: list[Any],
    after: Callable[[Any, str], None] | None = None,
) -> None:
    """Run every state to the end, all live rows in one forward per step (prepare → forward →
    sample → one host copy → commit); ``after(state, phase_before)`` after each commit."""
    with torch.inference_mode():
        while live := [s for s in states if not s.finished]:
            rows = [decoder.prepare(s) for s in live]
            phases = [getattr(s, "phase", "") for s in live]
            host = decoder.sample(live, runner.run(rows)).tolist()
            for state, row, phase in zip(live, host, phases, strict=True):
                decoder.commit([state], [row])
                if after is not None:
                    after(state, phase)


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
    runner.run([RowSpec(ids, 0, [len(ids) - 1], AttentionKind.CAUSAL, kv=span)])
    span.length = len(ids)
    try:
        return span_kv(runner, span)
    finally:
        runner.pool.free(span)


def assert_cache_is_causal(runner: ModelRunner, span: KVPages, ids: list[int]) -> None:
    """The span's kept K/V equal a fresh causal prefill of ``ids`` (fp32 tolerance)."""
    keys, values = span_kv(runner, span)
    want_k, want_v = fresh_prefill(runner, ids)
    assert keys.shape == want_k.shape
    assert (keys - want_k).abs().max() <= 1e-5
    assert (values - want_v).abs().max() <= 1e-5
