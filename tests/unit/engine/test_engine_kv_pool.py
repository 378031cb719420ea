"""Admission by KV budget: the engine's KV pool decides who runs (runtime v2)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dllm_serve.config import EngineConfig
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.engine.engine import AsyncEngine
from dllm_serve.engine.outputs import IncrementalDetokenizer, RequestOutput
from dllm_serve.engine.request import Request
from dllm_serve.engine.scheduler import KVCapacityError, QueueFullError
from dllm_serve.models.kv_pool import KVPool
from dllm_serve.models.loader import LoadedModel, load_model
from dllm_serve_train.tiny_checkpoints import write_tiny_idlm

PROMPT = [11, 12, 13, 14, 15, 16]
PARAMS = DecodingParams(gen_length=24)


@pytest.fixture(scope="module")
def idlm(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = write_tiny_idlm(Path(tmp_path_factory.mktemp("idlm")) / "tiny-idlm")
    return load_model(str(path), device="cpu", dtype="float32")


def gib_for(loaded: LoadedModel, slots: int) -> float:
    cfg = loaded.model.config
    per_slot = KVPool.bytes_per_slot(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, loaded.dtype)
    return slots * per_slot / 2**30


def request(engine: AsyncEngine, name: str, outputs: list[RequestOutput]) -> Request:
    return Request(
        request_id=name,
        prompt_ids=PROMPT,
        params=PARAMS,
        sink=outputs.append,
        detokenizer=IncrementalDetokenizer(engine._decode),
    )


def test_a_request_that_does_not_fit_waits_then_runs(idlm: LoadedModel) -> None:
    probe = AsyncEngine(idlm, EngineConfig())
    need = probe.algorithm.kv_tokens(len(PROMPT), PARAMS)
    # Room for one request's worst case, not two.
    engine = AsyncEngine(idlm, EngineConfig(kv_cache_memory=gib_for(idlm, need + need // 2)))
    pool = engine.runner.pool
    # Pages for one request's worst case, not two.
    assert pool is not None and pool.pages_for(need) <= pool.num_pages < 2 * pool.pages_for(need)
    outs: dict[str, list[RequestOutput]] = {"a": [], "b": []}
    engine.scheduler.waiting.extend(request(engine, n, outs[n]) for n in "ab")
    engine._admit()
    assert [r.request_id for r in engine.scheduler.running] == ["a"]
    assert [r.request_id for r in engine.scheduler.waiting] == ["b"]  # waits, not rejected
    assert pool.reserved_pages == pool.pages_for(need)
    steps = 0
    while engine.scheduler.running or engine.scheduler.waiting:
        for group in engine.scheduler.groups():
            engine._forward(group)
        engine._admit()
        steps += 1
        assert steps < 200
        if not outs["a"] or not outs["a"][-1].finished:
            assert not outs["b"], "b started before a released its KV"
    assert pool.reserved_pages == pool.pages_used == 0  # back to idle
    texts = {n: "".join(o.delta_text for o in outs[n]) for n in "ab"}
    assert outs["a"][-1].finish_reason in ("stop", "length") and texts["a"] == texts["b"]


def test_requests_waiting_for_kv_count_against_the_waiting_limit(idlm: LoadedModel) -> None:
    # Free running slots must not be subtracted from the queue while the pool holds it back,
    # or --max-waiting-requests would never refuse anyone waiting for KV.
    need = AsyncEngine(idlm, EngineConfig()).algorithm.kv_tokens(len(PROMPT), PARAMS)
    config = EngineConfig(max_waiting_requests=1, kv_cache_memory=gib_for(idlm, need + need // 2))
    engine = AsyncEngine(idlm, config)
    # The engine thread is not started (admission is driven by hand below); _submit only asks
    # whether it is alive.
    engine._thread = SimpleNamespace(is_alive=lambda: True)  # type: ignore[assignment]
    outs: list[RequestOutput] = []
    engine._submit(request(engine, "a", outs))
    engine._submit(request(engine, "b", outs))  # 2 in the queue, 32 free slots: accepted
    engine.scheduler.waiting.extend(engine.inbox.requests)
    engine.inbox.requests.clear()
    engine._admit()
    assert engine.num_running == 1 and engine.num_waiting == 1  # b waits for KV
    with pytest.raises(QueueFullError, match=r"^1 request\(s\) already waiting \(limit 1\)"):
        engine._submit(request(engine, "c", outs))


def test_a_burst_counts_as_waiting_as_soon_as_the_pool_holds_it_back(idlm: LoadedModel) -> None:
    # Before an admission pass has seen the pool blocked, free running slots must not all
    # count as starting, or a burst on an idle server would queue up to max_running − 1
    # requests past --max-waiting-requests.
    need = AsyncEngine(idlm, EngineConfig()).algorithm.kv_tokens(len(PROMPT), PARAMS)
    config = EngineConfig(
        max_running_requests=4,
        max_waiting_requests=1,
        kv_cache_memory=gib_for(idlm, need + need // 2),  # room for one request at a time
    )
    engine = AsyncEngine(idlm, config)
    engine._thread = SimpleNamespace(is_alive=lambda: True)  # type: ignore[assignment]
    outs: list[RequestOutput] = []
    engine._submit(request(engine, "a", outs))  # starts at the next pass
    engine._submit(request(engine, "b", outs))  # waits for a's KV
    with pytest.raises(QueueFullError, match=r"^1 request\(s\) already waiting \(limit 1\)"):
        engine._submit(request(engine, "c", outs))
    assert engine.num_waiting == 2  # a and b, before any admission pass


def test_a_request_that_can_never_fit_is_refused_at_submission(idlm: LoadedModel) -> None:
    engine = AsyncEngine(idlm, EngineConfig(kv_cache_memory=gib_for(idlm, 16)))
    engine._thread = SimpleNamespace(is_alive=lambda: True)  # type: ignore[assignment]
    outs: list[RequestOutput] = []
    need = engine.algorithm.kv_tokens(len(PROMPT), PARAMS)
    with pytest.raises(KVCapacityError) as refused:
        engine._submit(request(engine, "big", outs))
    assert str(refused.value) == (
        f"the request needs {need} KV-cache slots (its prompt, max tokens and decoding "
        "scratch), but the KV cache holds 16"
    )
    assert engine.num_waiting == 0 and not outs


def test_the_pool_returns_to_idle_after_concurrent_isd_requests(idlm: LoadedModel) -> None:
    engine = AsyncEngine(idlm, EngineConfig(max_running_requests=4, isd_stride=4))
    engine.start()
    pool = engine.runner.pool
    assert pool is not None
    seen_used: list[int] = []
    spans_exact: list[bool] = []
    real_commit = engine.algorithm.commit

    def commit(states, rows):  # type: ignore[no-untyped-def]
        results = real_commit(states, rows)
        for state in states:  # after every round the kept KV is exactly prompt + emitted[:-1]
            if state.kv is not None and not state.finished:
                spans_exact.append(state.kv.length == len(PROMPT) + len(state.emitted) - 1)
        seen_used.append(pool.pages_used)
        return results

    engine.algorithm.commit = commit  # type: ignore[method-assign]

    async def run_all() -> list[list[RequestOutput]]:
        async def one(i: int) -> list[RequestOutput]:
            params = DecodingParams(gen_length=16 + 4 * i, temperature=0.5 * (i % 2), seed=i)
            return [o async for o in engine.generate(PROMPT, params)]

        return await asyncio.gather(*(one(i) for i in range(6)))

    try:
        results = asyncio.run(run_all())
    finally:
        engine.shutdown()
    assert all(r[-1].finish_reason in ("stop", "length") for r in results)
    assert max(seen_used) > 0 and spans_exact and all(spans_exact)
    assert pool.reserved_pages == pool.pages_used == 0
    assert engine.kv_cache_bytes == 0


def test_a_pool_smaller_than_the_smallest_request_is_refused_at_start(idlm: LoadedModel) -> None:
    # Such a server would start healthy and answer every request with a 400. The pool is whole
    # pages: the smallest request (10 tokens here) needs one page of 16.
    algorithm = AsyncEngine(idlm).algorithm
    smallest = algorithm.kv_tokens(1, DecodingParams(gen_length=1))
    assert smallest <= 16
    message = r"room for 0 KV slots \(pages of 16\), fewer than the smallest request needs \("
    with pytest.raises(ValueError, match=message):
        AsyncEngine(idlm, EngineConfig(kv_cache_memory=gib_for(idlm, 15)))
    AsyncEngine(idlm, EngineConfig(kv_cache_memory=gib_for(idlm, 16)))


def test_kv_cache_memory_is_refused_where_there_is_no_pool(tmp_path: Path) -> None:
    # Found by QA: LLaDA without --kv-cache prefix ignored it silently.
    llada = load_model("tiny-llada", device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="keeps no KV cache, so it has no use for --kv-cache-"):
        AsyncEngine(llada, EngineConfig(kv_cache_memory=0.5))
    engine = AsyncEngine(llada, EngineConfig(kv_cache="prefix", kv_cache_memory=0.5))
    assert engine.runner.pool is not None


def test_a_pool_that_cannot_be_allocated_is_one_clear_error() -> None:
    # Found by QA: the allocator's traceback; 2**40 slots of 8 KiB cannot exist anywhere.
    message = r"the KV pool \(1099511627776 slots, .* GiB\) does not fit in cpu memory; lower"
    with pytest.raises(ValueError, match=message):
        KVPool(2, 4, 256, 1 << 40)


def test_a_device_fault_while_allocating_the_pool_is_not_called_a_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An error that mentions "memory" (an illegal memory access) is not a pool too large:
    # its cause must not be hidden.
    def fault(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch, "zeros", fault)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        KVPool(2, 4, 256, 16)
