"""``include_stop_str_in_output`` (vLLM): stop strings matched on the API side and kept.

The engine cuts the answer *before* a stop string. When the client asks for the stop string to
be kept, the route passes no stop strings to the engine and filters its text deltas here
instead: text is released as soon as it cannot be the start of a stop string, and at the first
stop string the answer ends with it included (``finish_reason: "stop"``); the engine request is
then aborted by closing its output iterator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence

from dllm_serve.engine.outputs import RequestOutput


def _first_stop(text: str, stops: Sequence[str]) -> int | None:
    """End index (exclusive) of the earliest stop string in ``text``, or None."""
    best: tuple[int, int] | None = None
    for stop in stops:
        i = text.find(stop)
        if i >= 0 and (best is None or (i, -len(stop)) < (best[0], -best[1])):
            best = (i, len(stop))
    return None if best is None else best[0] + best[1]


def _held_tail(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


async def keep_stop_strings(
    outputs: AsyncIterator[RequestOutput], stops: Sequence[str]
) -> AsyncIterator[RequestOutput]:
    """The engine's outputs, ending at (and including) the first of ``stops``."""
    held = ""  # unreleased text that could be the start of a stop string
    try:
        async for output in outputs:
            text = held + output.delta_text
            end = _first_stop(text, stops)
            if end is not None:
                yield dataclasses.replace(
                    output, delta_text=text[:end], finished=True, finish_reason="stop", error=None
                )
                return
            if output.finished:
                yield dataclasses.replace(output, delta_text=text)
                return
            keep = _held_tail(text, stops)
            held = text[len(text) - keep :]
            yield dataclasses.replace(output, delta_text=text[: len(text) - keep])
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]  # aborts an unfinished request
