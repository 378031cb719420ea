"""The paged KV pool under the engine: admission by pages (no fragmentation), pages taken as
contexts grow and given back exactly on trims, finish and abort, and no head-of-line blocking
(a bounded bypass, so the head never starves)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from dllm_serve.config import EngineConfig
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.engine.engine import AsyncEngine
from dllm_serve.engine.outputs import IncrementalDetokenizer, RequestOutput
from dllm_serve.engine.request import Request
from dllm_serve.engine.scheduler import MAX_BYPASS
from dllm_serve.models.kv_pool import PAGE_SIZE, KVPool
from dllm_serve.models.loader import LoadedModel, load_model
from dllm_serve_train.tiny_checkpoints import write_tiny_idlm

PROMPT = [11, 12, 13, 14, 15, 16]


@pytest.fixture(scope="module")
def idlm(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = write_tiny_idlm(Path(tmp_path_factory.mktemp("idlm")) / "tiny-idlm")
    return load_model(str(path), device="cpu", dtype="float32")


def engine_with_pages(loaded: LoadedModel, pages: int, **config: object) -> AsyncEngine:
    cfg = loaded.model.config
    per_slot = KVPool.bytes_per_slot(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, loaded.dtype)
    gib = pages * PAGE_SIZE * per_slot / 2**30
    engine = AsyncEngine(loaded, EngineConfig(kv_cache_memory=gib, **config))  # type: ignore[arg-type]
    assert engine.runner.pool is not None and engine.runner.pool.num_pages == pages
    # Driven by hand; submit only asks whether the engine thread is alive.
    engine._thread = SimpleNamespace(is_alive=lambda: True)  # type: ignore[assignment]
    return engine


def submit(engine: AsyncEngine, name: str, gen_length: int) -> list[RequestOutput]:
    outs: list[RequestOutput] = []
    engine.inbox.requests.append(
        Request(
            request_id=name,
            prompt_ids=PROMPT,
            params=DecodingParams(gen_length=gen_length),
            sink=outs.append,
            detokenizer=IncrementalDetokenizer(engine._decode),
        )
    )
    return outs


def pages_of(engine: AsyncEngine, gen_length: int) -> int:
    pool = engine.runner.pool
    assert pool is not None
    need = engine.algorithm.kv_tokens(len(PROMPT), DecodingParams(gen_length=gen_length))
    return pool.pages_for(need)


def running(engine: AsyncEngine) -> list[str]:
    return [r.request_id for r in engine.scheduler.running]


def test_free_pages_anywhere_admit_a_request_no_contiguous_span_would_hold(
    idlm: LoadedModel,
) -> None:
    """Small, large, small running; the two small ones finish, leaving two holes apart. A
    request as large as both holes together starts at once, beside the large one."""
    small, large = 8, 40
    p_small, p_large = pages_of_lengths(idlm, small, large)
    engine = engine_with_pages(idlm, 2 * p_small + p_large)
    outs = {n: submit(engine, n, g) for n, g in (("s1", small), ("big", large), ("s2", small))}
    engine.scheduler.waiting.extend(engine.inbox.requests)
    engine.inbox.requests.clear()
    engine._admit()
    assert running(engine) == ["s1", "big", "s2"]
    pool = engine.runner.pool
    assert pool is not None and pool.free_pages == 0
    while not (done(outs["s1"]) and done(outs["s2"])):
        engine.step()
    # Two holes of p_small pages, apart: no contiguous span of 2 * p_small slots is free.
    assert "big" in running(engine) and pool.free_pages == 2 * p_small == p_large
    later = submit(engine, "later", large)
    engine.step()
    assert "later" in running(engine) and "big" in running(engine)
    while engine.scheduler.running or engine.scheduler.waiting or engine.inbox.requests:
        engine.step()
    assert later[-1].finish_reason in ("stop", "length")
    assert pool.pages_used == pool.reserved_pages == 0


def pages_of_lengths(loaded: LoadedModel, *lengths: int) -> list[int]:
    engine = AsyncEngine(loaded)
    return [pages_of(engine, g) for g in lengths]


def done(outs: list[RequestOutput]) -> bool:
    return bool(outs) and outs[-1].finished


def test_pages_follow_the_context_and_return_to_idle_after_load_with_aborts(
    idlm: LoadedModel,
) -> None:
    engine = AsyncEngine(idlm, EngineConfig(max_running_requests=6, isd_stride=4))
    pool = engine.runner.pool
    assert pool is not None
    exact: list[bool] = []
    real_commit = engine.algorithm.commit

    def commit(states, rows):  # type: ignore[no-untyped-def]
        results = real_commit(states, rows)
        for state in states:
            # Pages cover the positions the forward wrote; the engine trims right after.
            assert len(state.kv.pages) <= state.kv.reserved
        return results

    engine.algorithm.commit = commit  # type: ignore[method-assign]
    real_step = engine.step

    def step() -> bool:
        alive = real_step()
        for request in engine.scheduler.running:
            kv = request.state.kv
            exact.append(len(kv.pages) == pool.pages_for(kv.length))  # trimmed exactly
        assert pool.pages_used == sum(len(r.state.kv.pages) for r in engine.scheduler.running)
        return alive

    engine.step = step  # type: ignore[method-assign]
    engine.start()

    async def load() -> list[list[RequestOutput]]:
        async def one(i: int) -> list[RequestOutput]:
            params = DecodingParams(gen_length=12 + 6 * i, temperature=0.7 * (i % 2), seed=i)
            outs = []
            async for output in engine.generate(PROMPT, params):
                outs.append(output)
                if i % 3 == 2 and len(outs) == 2:
                    break  # the client leaves mid-answer: the request is aborted
            return outs

        return await asyncio.gather(*(one(i) for i in range(9)))

    try:
        results = asyncio.run(load())
        for _ in range(100):  # aborts land at the next step boundary
            if not engine.num_running and not engine.num_waiting:
                break
            asyncio.run(asyncio.sleep(0.02))
    finally:
        engine.shutdown()
    assert exact and all(exact)
    assert sum(1 for r in results if r and r[-1].finished) >= 6
    assert pool.pages_used == pool.reserved_pages == 0 and pool.free_pages == pool.num_pages
    assert engine.kv_cache_bytes == 0 and engine.kv_pages == (0, pool.num_pages)


def test_a_large_head_does_not_block_smaller_requests_and_does_not_starve(
    idlm: LoadedModel,
) -> None:
    small, large = 8, 40
    _, p_large = pages_of_lengths(idlm, small, large)
    # Room for the large one alone, or for the running small one plus smaller ones, not both.
    engine = engine_with_pages(idlm, p_large, max_running_requests=64)
    first = submit(engine, "first", small)
    engine.step()  # first runs
    head = submit(engine, "head", large)  # needs the whole pool: waits for first
    behind = [submit(engine, f"s{i}", small) for i in range(MAX_BYPASS + 4)]
    engine.step()
    assert "head" not in running(engine)
    # Smaller requests that fit start ahead of the waiting head, up to the pool's room.
    started = [r for r in running(engine) if r.startswith("s")]
    assert started and started == [f"s{i}" for i in range(len(started))]
    order: list[str] = []
    while engine.scheduler.running or engine.scheduler.waiting:
        before = set(running(engine))
        engine.step()
        order.extend(sorted(set(running(engine)) - before))
        assert len(order) < 500
    # The head started after at most MAX_BYPASS smaller ones passed it, never last.
    passed = len(started) + order.index("head") if "head" in order else None
    assert passed is not None and passed <= MAX_BYPASS
    assert order[-1] != "head"
    for outs in (first, head, *behind):
        assert done(outs) and outs[-1].finish_reason in ("stop", "length")
