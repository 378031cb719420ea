"""One offline call: submit a batch of requests together and collect their completions.

The engine thread hands each output straight to the caller's thread (``AsyncEngine.submit``
with a synchronous sink), so an offline call sets up, wakes and tears down no event loop, and
it also works inside a running one (a notebook cell), which it blocks as any call would.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import uuid6

from dllm_serve.decoding.params import DecodingParams
from dllm_serve.engine.engine import AsyncEngine
from dllm_serve.engine.outputs import RequestOutput

# (prompt ids, params, stop strings, include_stop) of one request.
OfflineRequest = tuple[list[int], DecodingParams, tuple[str, ...], bool]
ANSWERED = ("stop", "length")


@dataclass(frozen=True, slots=True)
class Completion:
    """One finished generation."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    nfe: int  # forward passes this request took part in
    committed: int = 0  # canvas positions decoded (answer + EOS padding)
    drafted: int = 0  # self-speculation (ISD, LinearSpec): drafts verified ...
    accepted_drafts: int = 0  # ... and accepted
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache


@dataclass(slots=True)
class _Collected:
    """One request's outputs as the engine thread delivers them."""

    parts: list[str] = field(default_factory=list)
    last: RequestOutput | None = None  # the finished output, once it came

    @property
    def failed(self) -> bool:
        return self.last is not None and self.last.finish_reason not in ANSWERED

    def completion(self) -> Completion:
        last = self.last
        assert last is not None
        if last.finish_reason not in ANSWERED:
            raise RuntimeError(f"generation failed: {last.error or last.finish_reason}")
        return Completion(
            "".join(self.parts),
            last.finish_reason,
            last.prompt_tokens,
            last.completion_tokens,
            last.nfe,
            last.committed,
            last.drafted or 0,
            last.accepted_drafts or 0,
            last.cached_tokens,
        )


def run_together(engine: AsyncEngine, requests: Sequence[OfflineRequest]) -> list[Completion]:
    """Every request submitted together (the engine's first step admits them all), then their
    completions in order. The first request to fail ends the call at once: it raises
    ``RuntimeError("generation failed: …")`` and the call's other requests are aborted, as
    they are on any other exception (an interrupt while waiting, a refused submission)."""
    ids = [str(uuid6.uuid7()) for _ in requests]
    collected = [_Collected() for _ in requests]
    pending = [len(requests)]  # counted down on the engine thread, the only caller of sinks
    done = threading.Event()

    def sink_for(result: _Collected) -> Callable[[RequestOutput], None]:
        def sink(output: RequestOutput) -> None:  # on the engine thread
            result.parts.append(output.delta_text)
            if output.finished:
                result.last = output
                pending[0] -= 1
                if not pending[0] or result.failed:
                    done.set()

        return sink

    submitted = 0
    try:
        with engine.submitting_together():
            for (prompt, params, stop, include), request_id, result in zip(
                requests, ids, collected, strict=True
            ):
                engine.submit(
                    prompt, params, sink_for(result), request_id,
                    stop=stop, final_only=True, include_stop=include,
                )  # fmt: skip
                submitted += 1
        if requests:
            done.wait()
        for result in collected:
            if result.failed:
                result.completion()  # raises with the engine's error
        return [result.completion() for result in collected]
    except BaseException:
        for request_id, result in zip(ids[:submitted], collected, strict=False):
            if result.last is None:
                engine.abort(request_id)
        raise
