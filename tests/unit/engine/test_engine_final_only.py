"""final_only: a non-streamed answer is decoded once, at the end, and arrives whole."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from dllm_serve.config import EngineConfig
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.engine.engine import AsyncEngine
from dllm_serve.engine.outputs import NullObserver, RequestOutput
from dllm_serve.models.loader import LoadedModel, load_model

PARAMS = DecodingParams(gen_length=16, steps=8, block_length=4)


class FirstContent(NullObserver):
    def __init__(self) -> None:
        self.first_content: list[float] = []

    def on_first_content(self, seconds_since_arrival: float) -> None:
        self.first_content.append(seconds_since_arrival)


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model("demo-llada", device="cpu", dtype="float32")


@pytest.fixture
def observed(loaded: LoadedModel) -> Iterator[tuple[AsyncEngine, FirstContent]]:
    observer = FirstContent()
    eng = AsyncEngine(loaded, EngineConfig(max_running_requests=4), observer=observer)
    eng.start()
    yield eng, observer
    eng.shutdown()


def prompt(loaded: LoadedModel, text: str) -> list[int]:
    return loaded.chat_prompt_ids([{"role": "user", "content": text}])


async def collect(engine: AsyncEngine, ids: list[int], **kwargs: object) -> list[RequestOutput]:
    return [out async for out in engine.generate(ids, PARAMS, **kwargs)]  # type: ignore[arg-type]


def test_one_output_with_the_whole_streamed_answer(
    observed: tuple[AsyncEngine, FirstContent], loaded: LoadedModel
) -> None:
    engine, observer = observed
    ids = prompt(loaded, "What is 358 + 677?")
    streamed = asyncio.run(collect(engine, ids))
    whole = asyncio.run(collect(engine, ids, final_only=True))
    assert len(streamed) > 1  # the answer grows over several steps when streamed
    assert len(whole) == 1 and whole[0].finished
    assert whole[0].delta_text == "".join(o.delta_text for o in streamed) == "358 + 677 = 1035"
    last = streamed[-1]
    assert (whole[0].finish_reason, whole[0].completion_tokens, whole[0].nfe) == (
        last.finish_reason,
        last.completion_tokens,
        last.nfe,
    )
    # Time to first content is still observed once per request (at its first final token).
    assert len(observer.first_content) == 2


def test_stop_strings_still_stop_early(
    observed: tuple[AsyncEngine, FirstContent], loaded: LoadedModel
) -> None:
    engine, _ = observed
    ids = prompt(loaded, "What is 358 + 677?")
    outs = asyncio.run(collect(engine, ids, stop=(" = ",), final_only=True))
    assert "".join(o.delta_text for o in outs) == "358 + 677"
    assert outs[-1].finish_reason == "stop"
    # The stop string was found while decoding, before the canvas was finished.
    assert outs[-1].nfe < asyncio.run(collect(engine, ids, final_only=True))[0].nfe


def test_an_offline_batch_starts_in_one_step(loaded: LoadedModel) -> None:
    # LLM.generate submits the whole batch under the engine's lock: the first forward holds
    # every row, so the batch takes the forwards of one request, never one more.
    from dllm_serve.llm import LLM

    with LLM.from_loaded(loaded) as llm:
        forwards: list[int] = []
        original = llm.engine.runner.forward

        def counting(batch):  # type: ignore[no-untyped-def]
            forwards.append(sum(g.rows for g in batch.groups))
            return original(batch)

        llm.engine.runner.forward = counting  # type: ignore[method-assign]
        params = DecodingParams(gen_length=8, steps=8, block_length=8)
        conversations = [[{"role": "user", "content": f"What is {i} + {i}?"}] for i in range(12)]
        for _ in range(5):  # submission racing the engine thread would show within a few
            forwards.clear()
            outs = llm.generate(conversations, params)
            assert forwards == [12] * 8
            assert [o.nfe for o in outs] == [8] * 12
