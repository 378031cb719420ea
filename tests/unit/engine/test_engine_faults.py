"""Faults that surface: a device fault stops the engine with a final error for every request
(running and queued, whatever a sink does), admission never loses a request, and a CUDA graph
that fails to capture runs eagerly, never captured again. Faults are injected on CPU."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dllm_serve.config import EngineConfig
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.engine.engine import AsyncEngine, DeviceFault, EngineDeadError
from dllm_serve.engine.graphs import GraphRunner, StaticForward
from dllm_serve.engine.model_runner import ModelRunner
from dllm_serve.engine.outputs import RequestOutput
from dllm_serve.models.loader import LoadedModel, load_model

PARAMS = DecodingParams(gen_length=16, steps=16)
FAULT = "CUDA error: an illegal memory access was encountered"


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-llada", device="cpu", dtype="float32")


def _collect(engine: AsyncEngine, n: int) -> list[list[RequestOutput]]:
    outs: list[list[RequestOutput]] = [[] for _ in range(n)]
    with engine.submitting_together():
        for i in range(n):
            engine.submit([5 + i, 6, 7], PARAMS, outs[i].append)
    return outs


def _wait(outs: list[list[RequestOutput]], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not all(o and o[-1].finished for o in outs):
        assert time.monotonic() < deadline, [len(o) for o in outs]
        time.sleep(0.01)


def test_a_device_fault_stops_the_engine_and_finishes_every_request(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two running rows and two queued behind them (max 2 running).
    engine = AsyncEngine(tiny, EngineConfig(max_running_requests=2))
    calls = {"n": 0}
    real_run = engine.runner.run

    def run(rows: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            raise torch.AcceleratorError(FAULT)
        return real_run(rows)

    monkeypatch.setattr(engine.runner, "run", run)
    died: list[BaseException] = []
    engine.on_dead.append(died.append)
    engine.start()
    outs = _collect(engine, 4)
    _wait(outs)
    assert calls["n"] == 3  # nothing ran after the fault
    for out in outs:
        assert out[-1].finish_reason == "error"
        assert "DeviceFault" in (out[-1].error or "") and FAULT in (out[-1].error or "")
    assert not engine.is_alive
    assert isinstance(engine.dead, DeviceFault) and len(died) == 1 and died[0] is engine.dead
    with pytest.raises(EngineDeadError):
        engine.submit([1, 2], PARAMS, lambda output: None)
    engine.shutdown()


def test_an_ordinary_forward_error_fails_its_rows_only(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = AsyncEngine(tiny, EngineConfig(max_running_requests=1))
    calls = {"n": 0}
    real_run = engine.runner.run

    def run(rows: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise torch.OutOfMemoryError("out of memory")  # not sticky: the next forward runs
        return real_run(rows)

    monkeypatch.setattr(engine.runner, "run", run)
    engine.start()
    outs = _collect(engine, 2)
    _wait(outs)
    assert [o[-1].finish_reason for o in outs] == ["error", "length"]
    assert engine.is_alive and engine.dead is None
    engine.shutdown()


def test_a_raising_sink_costs_no_other_request_its_final_output(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = AsyncEngine(tiny, EngineConfig(max_running_requests=4))
    monkeypatch.setattr(
        engine.runner, "run", lambda rows: (_ for _ in ()).throw(torch.AcceleratorError(FAULT))
    )
    seen: list[RequestOutput] = []

    def broken(output: RequestOutput) -> None:
        raise RuntimeError("the consumer is gone")

    engine.start()
    with engine.submitting_together():
        engine.submit([1, 2, 3], PARAMS, broken)
        engine.submit([1, 2, 4], PARAMS, seen.append)
        engine.submit([1, 2, 5], PARAMS, broken)
    _wait([seen])
    assert seen[-1].finish_reason == "error" and not engine.is_alive
    engine.shutdown()


def test_admission_finishes_a_request_whose_kv_need_fails(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = AsyncEngine(tiny)
    engine._thread = SimpleNamespace(is_alive=lambda: True)  # type: ignore[assignment]
    real_need = engine.kv.need

    def need(prompt_tokens: int, params: DecodingParams) -> int:
        if prompt_tokens == 5:
            raise ValueError("no such request size")
        return real_need(prompt_tokens, params)

    outs: list[list[RequestOutput]] = [[], []]
    engine.submit([1, 2, 3, 4, 5], PARAMS, outs[0].append)
    engine.submit([1, 2, 3], PARAMS, outs[1].append)
    # Accepted at submission; the first fails when admission asks what it needs.
    monkeypatch.setattr(type(engine.kv), "need", lambda self, n, p: need(n, p))
    while not all(o and o[-1].finished for o in outs):
        engine.step()
    assert outs[0][-1].finish_reason == "error" and "no such request size" in outs[0][-1].error
    assert outs[1][-1].finish_reason == "length"
    assert not engine.scheduler.waiting and not engine.scheduler.running


def test_a_graph_that_fails_to_capture_runs_eagerly_and_is_never_captured_again(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = AsyncEngine(tiny, EngineConfig(kv_cache="prefix"))
    model = engine.runner.model
    reference = AsyncEngine(tiny, EngineConfig(kv_cache="prefix"))
    runner = ModelRunner(
        model, torch.device("cpu"), kv_slots=engine.runner.pool.slots, cuda_graph=True,
        mask_id=tiny.mask_id,
    )  # fmt: skip
    assert runner.graphs is not None  # the padded static forward, uncaptured on CPU
    runner.graphs.capture = True  # as on CUDA: capture each new shape
    attempts = {"n": 0}

    def capture(self: StaticForward, pool: Any) -> None:
        attempts["n"] += 1
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(StaticForward, "capture", capture)
    engine.runner = runner
    engine.kv = type(engine.kv)(runner.pool, engine.algorithm)
    params = DecodingParams(gen_length=16, steps=16, block_length=8)
    outs: list[RequestOutput] = []
    want: list[RequestOutput] = []
    for eng, sink in ((engine, outs.append), (reference, want.append)):
        eng._thread = SimpleNamespace(is_alive=lambda: True)  # type: ignore[assignment]
        eng.submit([5, 6, 7], params, sink)
    while not (outs and outs[-1].finished):
        engine.step()
    while not (want and want[-1].finished):
        reference.step()
    assert outs[-1].finish_reason == want[-1].finish_reason != "error"
    assert "".join(o.delta_text for o in outs) == "".join(o.delta_text for o in want)
    assert isinstance(runner.graphs, GraphRunner)
    assert attempts["n"] == len(runner.graphs.failed) >= 1  # one attempt per shape, no retry
    assert runner.graphs.replays == 0
