"""``--kv-cache prefix`` through the engine: batching, freeing, the gauge, the flag."""

from __future__ import annotations

import asyncio
import functools
import time
import weakref

import pytest
import torch
from prometheus_client import generate_latest

from dllm_serve.api.metrics import Metrics
from dllm_serve.cli import parse_config
from dllm_serve.config import EngineConfig
from dllm_serve.decoding.denoise import LLaDADenoiser
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.engine.engine import AsyncEngine
from dllm_serve.engine.outputs import RequestOutput
from dllm_serve.models.kv_cache import KVBatch, KVCache
from dllm_serve.models.loader import LoadedModel, load_model


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model("tiny-llada", device="cpu", dtype="float32")


def alone(loaded: LoadedModel, ids: list[int], params: DecodingParams) -> list[int]:
    """The prefix-cached denoiser on its own, one row per forward, no engine."""
    algo = LLaDADenoiser(
        loaded.mask_id,
        loaded.stop_ids,
        kv_cache_factory=functools.partial(KVCache.for_model, loaded.model),
    )
    state = algo.init_state(ids, params, "cpu")
    with torch.inference_mode():
        while not state.finished:
            spec = algo.prepare(state)
            assert spec.kv_cache is not None
            cache = KVBatch([spec.kv_cache], write=[spec.kv_write])
            hidden = loaded.model(spec.input_ids[None], spec.positions[None], kv_cache=cache)
            algo.update(state, loaded.model.lm_head(hidden[0, spec.logits_index]))
    return state.answer_tokens()


async def collect(engine: AsyncEngine, ids: list[int], params: DecodingParams):
    return [out async for out in engine.generate(ids, params)]


def test_concurrent_cached_rows_match_running_alone(loaded: LoadedModel) -> None:
    """Rows at different blocks, prefix lengths and modes (one step per block: every step a
    full forward, the no-cache-equivalent row) share forwards and keep their tokens."""
    ids = [loaded.chat_prompt_ids([{"role": "user", "content": t}]) for t in ("a", "bbb", "cc")]
    cases = [
        (ids[0], DecodingParams(gen_length=12, block_length=4, steps=12)),
        (ids[1], DecodingParams(gen_length=8, block_length=2, steps=4)),  # refresh only
        (ids[2], DecodingParams(gen_length=9, block_length=3, steps=9, confidence_threshold=0.3)),
        (ids[1], DecodingParams(gen_length=8, steps=4, temperature=1.0, seed=7)),  # 1 block
    ]
    engine = AsyncEngine(loaded, EngineConfig(max_running_requests=4, kv_cache="prefix"))
    engine.start()
    try:

        async def all_at_once() -> list[list[RequestOutput]]:
            return await asyncio.gather(*(collect(engine, i, p) for i, p in cases))

        results = asyncio.run(all_at_once())
        assert engine.kv_cache_bytes == 0  # every request finished: nothing held
    finally:
        engine.shutdown()
    for (i, params), outs in zip(cases, results, strict=True):
        assert outs[-1].finished and outs[-1].error is None
        expected = loaded.decode(alone(loaded, i, params))
        assert "".join(o.delta_text for o in outs) == expected


def test_abort_frees_the_cache(loaded: LoadedModel) -> None:
    engine = AsyncEngine(loaded, EngineConfig(max_running_requests=2, kv_cache="prefix"))
    engine.start()
    ids = loaded.chat_prompt_ids([{"role": "user", "content": "x"}])
    long = DecodingParams(gen_length=64, block_length=8, steps=64)
    try:

        async def scenario() -> tuple[int, weakref.ref]:
            task = asyncio.ensure_future(collect(engine, ids, long))
            for _ in range(400):  # wait until the request runs and holds its cache
                running = list(engine.scheduler.running)
                if running and running[0].state is not None:
                    break
                await asyncio.sleep(0.005)
            state = running[0].state
            assert state is not None and state.kv_cache is not None
            held, ref = engine.kv_cache_bytes, weakref.ref(state.kv_cache)
            del state, running
            task.cancel()  # a disconnected client: the generator's finally aborts
            await asyncio.gather(task, return_exceptions=True)
            for _ in range(400):
                if engine.num_running == 0:
                    break
                await asyncio.sleep(0.005)
            return held, ref

        held, ref = asyncio.run(scenario())
        cfg = loaded.model.config
        per_position = 2 * 4 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim  # K+V, fp32
        assert held == per_position * (len(ids) + 64 - 8)  # the last block's prefix
        assert engine.num_running == 0 and engine.kv_cache_bytes == 0
        for _ in range(100):  # the engine thread may still be unwinding its iteration
            if ref() is None:
                break
            time.sleep(0.01)
        assert ref() is None  # nothing else kept the aborted request's cache alive
    finally:
        engine.shutdown()


def test_no_cache_engine_holds_nothing(loaded: LoadedModel) -> None:
    engine = AsyncEngine(loaded, EngineConfig())
    assert engine.algorithm.kv_cache_factory is None and engine.kv_cache_bytes == 0


def test_gauge_reads_the_engine_at_scrape_time() -> None:
    held = [0]
    metrics = Metrics(lambda: 0, lambda: 0, lambda: held[0])
    assert b"dllm:kv_cache_bytes 0.0" in generate_latest(metrics.registry)
    held[0] = 4096
    assert b"dllm:kv_cache_bytes 4096.0" in generate_latest(metrics.registry)


def test_kv_cache_flag() -> None:
    assert parse_config([]).engine.kv_cache == "none"
    assert parse_config(["--kv-cache", "prefix"]).engine.kv_cache == "prefix"
    with pytest.raises(SystemExit):
        parse_config(["--kv-cache", "dual"])
    with pytest.raises(ValueError, match="kv_cache"):
        EngineConfig(kv_cache="dual")
