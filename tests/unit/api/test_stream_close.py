"""A response stream closed early closes the engine's iterator at once (which aborts the
request), not when the garbage collector finalises it (found by a code review)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest

from dllm_serve.api.playground import trace_events
from dllm_serve.api.streaming import chat_chunks, merged, text_chunks
from dllm_serve.engine.outputs import RequestOutput


def _output(text: str) -> RequestOutput:
    return RequestOutput(
        request_id="r",
        delta_text=text,
        prompt_tokens=3,
        completion_tokens=1,
        nfe=1,
        committed=1,
        step=1,
        block=0,
    )


async def _first_event_then_close(make_stream) -> list[str]:  # type: ignore[no-untyped-def]
    events: list[str] = []

    async def engine_outputs() -> AsyncGenerator[RequestOutput, None]:
        try:
            yield _output("1 + 1")
            yield _output(" = 2")
            await asyncio.sleep(3600)  # the rest of the answer never comes
            yield _output("")
        finally:
            events.append("engine iterator closed")

    stream = make_stream(engine_outputs())
    await stream.__anext__()
    await stream.__anext__()
    await stream.aclose()
    events.append("response closed")
    return events


@pytest.mark.parametrize("chunks", [chat_chunks, text_chunks])
def test_closing_a_completion_stream_closes_the_engine_iterator_first(chunks) -> None:  # type: ignore[no-untyped-def]
    def make(outputs):  # type: ignore[no-untyped-def]
        return chunks(
            merged([outputs]), response_id="x", created=0, model="m", canvas_length=8,
            include_usage=False,
        )  # fmt: skip

    events = asyncio.run(_first_event_then_close(make))
    assert events == ["engine iterator closed", "response closed"]


def test_closing_a_trace_stream_closes_the_engine_iterator_first() -> None:
    events = asyncio.run(_first_event_then_close(lambda outputs: trace_events(outputs, 8, 3)))
    assert events == ["engine iterator closed", "response closed"]


def test_closing_a_stream_of_several_choices_closes_every_engine_iterator() -> None:
    async def run() -> list[str]:
        events: list[str] = []

        async def engine_outputs(name: str) -> AsyncGenerator[RequestOutput, None]:
            try:
                yield _output(name)
                await asyncio.sleep(3600)
                yield _output("")
            finally:
                events.append(f"{name} closed")

        stream = chat_chunks(
            merged([engine_outputs("a"), engine_outputs("b")]), response_id="x", created=0,
            model="m", canvas_length=8, include_usage=False, n=2,
        )  # fmt: skip
        for _ in range(4):  # two role chunks, then each choice's first text
            await stream.__anext__()
        await stream.aclose()
        events.append("response closed")
        return events

    events = asyncio.run(run())
    assert sorted(events[:2]) == ["a closed", "b closed"] and events[2] == "response closed"
