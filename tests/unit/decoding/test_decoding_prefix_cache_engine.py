"""``--kv-cache prefix`` through the engine: batching, freeing, the gauge, the flag."""

from __future__ import annotations

import asyncio

import pytest
import torch
from prometheus_client import generate_latest

from dllm_serve.api.metrics import Metrics
from dllm_serve.cli import parse_config
from dllm_serve.config import EngineConfig
from dllm_serve.decoding.canvas import LLaDADenoiser
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.engine.engine import AsyncEngine, KVCapacityError
from dllm_serve.engine.model_runner import ModelRunner
from dllm_serve.engine.outputs import RequestOutput
from dllm_serve.models.kv_pool import KVPool
from dllm_serve.models.loader import LoadedModel, load_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model("tiny-llada", device="cpu", dtype="float32")


def alone(loaded: LoadedModel, ids: list[int], params: DecodingParams) -> list[int]:
    """The prefix-cached denoiser on its own, one row per forward, no engine."""
    algo = LLaDADenoiser(loaded.mask_id, loaded.stop_ids, prefix_cache=True)
    need = algo.kv_tokens(len(ids), params)
    runner = ModelRunner(loaded.model, torch.device("cpu"), kv_slots=-(-need // 16) * 16)
    assert runner.pool is not None
    state = algo.init_state(ids, params, "cpu")
    state.kv = runner.pool.reserve(need)
    with torch.inference_mode():
        while not state.finished:
            spec = algo.prepare(state)
            assert spec.kv is state.kv
            logits = runner.run([spec])
            algo.commit([state], algo.sample([state], logits).tolist())
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
    pool = engine.runner.pool
    assert pool is not None and pool.reserved_pages == pool.pages_used == 0
    engine.start()
    ids = loaded.chat_prompt_ids([{"role": "user", "content": "x"}])
    long = DecodingParams(gen_length=64, block_length=8, steps=64)
    try:

        async def scenario():
            task = asyncio.ensure_future(collect(engine, ids, long))
            for _ in range(400):  # wait until the request runs and holds its span
                running = list(engine.scheduler.running)
                if running and running[0].state is not None:
                    break
                await asyncio.sleep(0.005)
            state = running[0].state
            assert state is not None and state.kv is not None
            held, span = engine.kv_cache_bytes, state.kv
            del state, running
            task.cancel()  # a disconnected client: the generator's finally aborts
            await asyncio.gather(task, return_exceptions=True)
            for _ in range(400):
                if engine.num_running == 0:
                    break
                await asyncio.sleep(0.005)
            return held, span

        held, span = asyncio.run(scenario())
        cfg = loaded.model.config
        per_slot = 2 * 4 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim  # K+V, fp32
        assert per_slot == KVPool.bytes_per_slot(
            cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, torch.float32
        )
        assert held == per_slot * (len(ids) + 64)  # the whole canvas, reserved at admission
        assert engine.num_running == 0 and engine.kv_cache_bytes == 0
        # The span went back to the pool (once: a freed span has no slots left to free) and
        # the pool is one free interval again.
        assert span.reserved == 0 and pool.reserved_pages == pool.pages_used == 0
        assert pool.free_pages == pool.num_pages
    finally:
        engine.shutdown()


def test_no_cache_engine_holds_nothing(loaded: LoadedModel) -> None:
    engine = AsyncEngine(loaded, EngineConfig())
    assert engine.algorithm.kv_tokens(10, DecodingParams(gen_length=8)) == 0
    assert engine.runner.pool is None and engine.kv_cache_bytes == 0


def test_kv_cache_memory_bounds_the_pool(loaded: LoadedModel) -> None:
    """``--kv-cache-memory`` sizes the pool: a request whose span does not fit next to the
    running one waits for it, one that could never fit is refused at submission."""
    cfg = loaded.model.config
    per_slot = KVPool.bytes_per_slot(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, torch.float32)
    gib = 48 * per_slot / (1 << 30)  # room for 48 slots: three pages of 16
    config = EngineConfig(max_running_requests=4, kv_cache="prefix", kv_cache_memory=gib)
    engine = AsyncEngine(loaded, config)
    pool = engine.runner.pool
    assert pool is not None and pool.slots == 48
    fits = DecodingParams(
        gen_length=24, block_length=8, steps=24
    )  # 27 slots, 2 pages: one at a time
    too_big = DecodingParams(gen_length=64, block_length=8, steps=64)
    prompts = [[5, 17, 8], [9, 10, 11]]
    engine.start()
    try:

        async def scenario():
            return await asyncio.gather(*(collect(engine, p, fits) for p in prompts))

        results = asyncio.run(scenario())
        with pytest.raises(KVCapacityError, match=r"needs 67 KV-cache slots .* holds 48$"):
            asyncio.run(collect(engine, [5, 17, 8], too_big))
        assert (
            engine.kv_cache_bytes == 0
            and pool.reserved_pages == pool.pages_used == 0
            and engine.num_waiting == 0
        )
    finally:
        engine.shutdown()
    for prompt, outs in zip(prompts, results, strict=True):
        assert outs[-1].finished and outs[-1].error is None
        assert "".join(o.delta_text for o in outs) == loaded.decode(alone(loaded, prompt, fits))


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
