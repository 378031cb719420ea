"""A request as the engine thread sees it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from dllm_serve.decoding.denoise import DenoiseState
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.engine.outputs import IncrementalDetokenizer, RequestOutput


class RequestStatus(StrEnum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One generation: its prompt, parameters, denoising state and output sink.

    ``sink`` is called on the engine thread with each :class:`RequestOutput`; the async side
    installs one that hops to the event loop with ``call_soon_threadsafe``.
    """

    request_id: str
    prompt_ids: list[int]
    params: DecodingParams
    sink: Callable[[RequestOutput], None]
    detokenizer: IncrementalDetokenizer
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    state: DenoiseState | None = None  # created on admission, on the engine thread
    first_content_time: float | None = None
    deadline: float | None = None  # time.monotonic() past which the request times out

    @property
    def row_length(self) -> int:
        """Tokens this request puts in a forward: prompt plus canvas."""
        return len(self.prompt_ids) + self.params.gen_length
