"""AsyncEngine on the embedded tiny checkpoint: outputs, isolation, abort, failures."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from dllm_serve.config import EngineConfig
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.engine.engine import AsyncEngine, EngineDeadError, QueueFullError
from dllm_serve.engine.outputs import NullObserver, RequestOutput
from dllm_serve.models.loader import LoadedModel, load_model

PARAMS = DecodingParams(gen_length=16, steps=8, block_length=4)


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model("tiny-llada", device="cpu", dtype="float32")


@pytest.fixture
def engine(loaded: LoadedModel) -> Iterator[AsyncEngine]:
    eng = AsyncEngine(loaded, EngineConfig(max_running_requests=4))
    eng.start()
    yield eng
    eng.shutdown()


async def collect(
    engine: AsyncEngine, prompt: list[int], params: DecodingParams
) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, params)]


def prompt(loaded: LoadedModel, text: str) -> list[int]:
    return loaded.chat_prompt_ids([{"role": "user", "content": text}])


def test_outputs_are_append_only_and_end_once(engine: AsyncEngine, loaded: LoadedModel) -> None:
    outs = asyncio.run(collect(engine, prompt(loaded, "hello"), PARAMS))
    assert outs[-1].finished and outs[-1].finish_reason in ("stop", "length")
    assert [o.finished for o in outs].count(True) == 1
    assert all(o.delta_text for o in outs[:-1])  # intermediate outputs only when text grew
    nfes = [o.nfe for o in outs]
    assert nfes == sorted(nfes) and 1 <= nfes[-1] <= PARAMS.steps
    text = "".join(o.delta_text for o in outs)
    assert outs[-1].completion_tokens <= PARAMS.gen_length
    assert outs[-1].prompt_tokens == len(prompt(loaded, "hello"))
    assert text == loaded.decode(_answer_tokens_alone(loaded, prompt(loaded, "hello"), PARAMS))


def _answer_tokens_alone(loaded: LoadedModel, ids: list[int], params: DecodingParams) -> list[int]:
    """Run the denoiser directly, with no engine around it."""
    import torch

    from dllm_serve.decoding.canvas import LLaDADenoiser

    algo = LLaDADenoiser(loaded.mask_id, loaded.stop_ids)
    state = algo.init_state(ids, params, loaded.device)
    with torch.inference_mode():
        while not state.finished:
            spec = algo.prepare(state)
            hidden = loaded.model(spec.input_ids[None], spec.positions[None], None)
            algo.update(state, loaded.model.lm_head(hidden[0, spec.logits_index]))
    return state.answer_tokens()


def test_concurrent_requests_match_running_alone(engine: AsyncEngine, loaded: LoadedModel) -> None:
    cases = [
        (prompt(loaded, "a"), DecodingParams(gen_length=16, steps=16, block_length=8)),
        (prompt(loaded, "bb"), DecodingParams(gen_length=8, steps=4, temperature=1.0, seed=3)),
        (
            prompt(loaded, "ccc"),
            DecodingParams(gen_length=12, steps=6, block_length=4, temperature=0.5, seed=9),
        ),
        (prompt(loaded, "a"), DecodingParams(gen_length=16, steps=8, temperature=1.0, seed=3)),
        (prompt(loaded, "dd"), PARAMS),
    ]

    async def all_at_once() -> list[list[RequestOutput]]:
        return await asyncio.gather(*(collect(engine, p, params) for p, params in cases))

    results = asyncio.run(all_at_once())  # 5 requests, 4 running slots: one waits
    for (ids, params), outs in zip(cases, results, strict=True):
        expected = loaded.decode(_answer_tokens_alone(loaded, ids, params))
        assert "".join(o.delta_text for o in outs) == expected


class FinishRecorder(NullObserver):
    """Records every finished output the engine reports (on the engine thread)."""

    def __init__(self) -> None:
        self.finished: list[RequestOutput] = []

    def on_finished(self, output: RequestOutput, seconds_since_arrival: float) -> None:
        self.finished.append(output)


def test_abort_frees_the_request(loaded: LoadedModel) -> None:
    recorder = FinishRecorder()
    engine = AsyncEngine(loaded, EngineConfig(max_running_requests=4), observer=recorder)
    engine.start()
    long = DecodingParams(gen_length=512, steps=512)  # far longer than the test waits

    async def scenario() -> RequestOutput:
        gen = engine.generate(prompt(loaded, "x"), long, request_id="cancelled")
        task = asyncio.ensure_future(anext(gen))
        await task  # the request runs: it produced an output
        task = asyncio.ensure_future(anext(gen))
        await asyncio.sleep(0.05)
        task.cancel()  # like a disconnected client: the generator's finally aborts
        await asyncio.gather(task, return_exceptions=True)
        await gen.aclose()
        for _ in range(200):
            if engine.num_running == 0 and engine.num_waiting == 0:
                break
            await asyncio.sleep(0.01)
        # the engine still serves others afterwards
        outs = await collect(engine, prompt(loaded, "y"), PARAMS)
        return outs[-1]

    try:
        last = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert last.finish_reason in ("stop", "length")
    assert engine.num_running == 0 and engine.num_waiting == 0
    aborted = [o for o in recorder.finished if o.request_id == "cancelled"]
    assert len(aborted) == 1 and aborted[0].finish_reason == "abort"
    assert aborted[0].nfe < long.steps  # stopped by the abort, not by running to the end


def test_abort_by_id_from_another_thread(engine: AsyncEngine, loaded: LoadedModel) -> None:
    import threading

    async def scenario() -> list[RequestOutput]:
        outs = []
        gen = engine.generate(
            prompt(loaded, "x"), DecodingParams(gen_length=256, steps=256), request_id="victim"
        )
        threading.Timer(0.05, engine.abort, args=("victim",)).start()
        async for out in gen:
            outs.append(out)
        return outs

    outs = asyncio.run(scenario())
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert outs[-1].nfe < 256


def test_a_failing_request_does_not_disturb_others(
    engine: AsyncEngine, loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = engine.algorithm.commit

    def commit(states, rows):  # type: ignore[no-untyped-def]
        if any(state.params.seed == 666 for state in states):
            raise RuntimeError("boom")
        return original(states, rows)

    monkeypatch.setattr(engine.algorithm, "commit", commit)
    bad = DecodingParams(gen_length=8, steps=8, temperature=1.0, seed=666)
    good = DecodingParams(gen_length=8, steps=8, temperature=1.0, seed=5)
    ids = prompt(loaded, "z")

    async def both() -> list[list[RequestOutput]]:
        return await asyncio.gather(collect(engine, ids, bad), collect(engine, ids, good))

    bad_outs, good_outs = asyncio.run(both())
    assert bad_outs[-1].finish_reason == "error" and "boom" in (bad_outs[-1].error or "")
    assert good_outs[-1].finish_reason in ("stop", "length")
    monkeypatch.undo()
    expected = loaded.decode(_answer_tokens_alone(loaded, ids, good))
    assert "".join(o.delta_text for o in good_outs) == expected


def test_generate_after_shutdown_raises(loaded: LoadedModel) -> None:
    eng = AsyncEngine(loaded)
    eng.start()
    eng.shutdown()
    assert not eng.is_alive

    async def go() -> None:
        async for _ in eng.generate([1, 2], PARAMS):
            pass

    with pytest.raises(EngineDeadError):
        asyncio.run(go())


def test_full_waiting_queue_refuses_at_once(loaded: LoadedModel) -> None:
    eng = AsyncEngine(loaded, EngineConfig(max_running_requests=1, max_waiting_requests=1))
    eng.start()
    # Long enough that the first cannot finish between three submissions microseconds apart
    # (its 64 forwards take tens of milliseconds); the refusal itself does not depend on timing.
    long = DecodingParams(gen_length=64, steps=64)
    a, b, c = (prompt(loaded, t) for t in "abc")

    async def scenario() -> None:
        # Three submissions microseconds apart: one may run, one may wait, the third is refused.
        first = eng.generate(a, long)
        second = eng.generate(b, long)
        with pytest.raises(QueueFullError):
            eng.generate(c, long)
        for stream in (first, second):  # nothing accepted is lost
            outs = [o async for o in stream]
            assert outs[-1].finish_reason in ("stop", "length")

    try:
        asyncio.run(scenario())
    finally:
        eng.shutdown()


def test_no_waiting_queue_still_runs_what_fits(loaded: LoadedModel) -> None:
    # --max-waiting-requests 0 means "no queue": a request that gets a free slot runs, one
    # that would have to wait is refused (it had refused every request, even on an idle engine).
    eng = AsyncEngine(loaded, EngineConfig(max_running_requests=1, max_waiting_requests=0))
    eng.start()
    long = DecodingParams(gen_length=64, steps=64)

    async def scenario() -> None:
        first = eng.generate(prompt(loaded, "a"), long)
        with pytest.raises(QueueFullError, match=r"^0 request\(s\) already waiting \(limit 0\)$"):
            eng.generate(prompt(loaded, "b"), long)
        outs = [o async for o in first]
        assert outs[-1].finish_reason in ("stop", "length")

    try:
        asyncio.run(scenario())
    finally:
        eng.shutdown()


def test_concurrent_rows_share_forwards(loaded: LoadedModel) -> None:
    rows: list[int] = []

    class Recorder:
        def on_forward(self, n: int, tokens: int, seconds: float) -> None:
            rows.append(n)

        def on_iteration(self, busy_seconds: float) -> None: ...
        def on_first_content(self, seconds: float) -> None: ...
        def on_finished(self, output: RequestOutput, seconds: float) -> None: ...

    eng = AsyncEngine(loaded, observer=Recorder())
    eng.start()

    async def scenario() -> None:
        params = DecodingParams(gen_length=32, steps=32)
        await asyncio.gather(*(collect(eng, prompt(loaded, t), params) for t in "abcd"))

    try:
        asyncio.run(scenario())
    finally:
        eng.shutdown()
    assert max(rows) == 4 and sum(rows) / len(rows) > 1


def test_a_failing_forward_fails_only_its_batch(
    engine: AsyncEngine, loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_forward = engine.runner.forward
    calls = {"n": 0}

    def flaky(batch):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("CUDA error: device-side assert (simulated)")
        return real_forward(batch)

    monkeypatch.setattr(engine.runner, "forward", flaky)
    params = DecodingParams(gen_length=8, steps=8)

    async def scenario() -> tuple[list[RequestOutput], list[RequestOutput]]:
        first = await collect(engine, prompt(loaded, "a"), params)
        second = await collect(engine, prompt(loaded, "b"), params)
        return first, second

    first, second = asyncio.run(scenario())
    assert first[-1].finish_reason == "error" and "simulated" in (first[-1].error or "")
    assert second[-1].finish_reason in ("stop", "length")  # the engine kept serving
    assert engine.is_alive


def test_engine_thread_death_is_reported(loaded: LoadedModel) -> None:
    eng = AsyncEngine(loaded)

    def explode() -> None:
        raise SystemError("loop bug (simulated)")

    eng._admit = explode  # type: ignore[method-assign]
    eng.start()

    async def scenario() -> list[RequestOutput]:
        return await collect(eng, prompt(loaded, "a"), PARAMS)

    outs = asyncio.run(scenario())
    assert outs[-1].finish_reason == "error" and "engine died" in (outs[-1].error or "")
    eng._thread.join(5)
    assert not eng.is_alive
    with pytest.raises(EngineDeadError):
        asyncio.run(scenario())
