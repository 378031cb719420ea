"""A request as the engine thread sees it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dllm_serve.decoding.params import DecodingParams
from dllm_serve.decoding.protocol import DecodeState
from dllm_serve.engine.outputs import IncrementalDetokenizer, RequestOutput


@dataclass(eq=False)
class Request:
    """One generation: its prompt, parameters, denoising state and output sink.

    ``sink`` receives each :class:`RequestOutput`: on the engine thread when ``loop`` is None,
    else on ``loop`` — the engine batches one step's outputs per loop into one
    ``call_soon_threadsafe`` (one wake-up per step, not one per row).
    """

    request_id: str
    prompt_ids: list[int]
    params: DecodingParams
    sink: Callable[[RequestOutput], None]
    detokenizer: IncrementalDetokenizer
    arrival_time: float = field(default_factory=time.monotonic)
    state: DecodeState | None = None  # created on admission, on the engine thread
    first_content_time: float | None = None
    deadline: float | None = None  # time.monotonic() past which the request times out
    loop: asyncio.AbstractEventLoop | None = None  # where ``sink`` runs (None: engine thread)
    trace: bool = False  # one trace event per step in the outputs (engine/outputs.py)
    trace_started: bool = False  # the start event went out (with the first step's)
    # Requests that started before this one while it waited for KV pages (bounded bypass).
    bypassed: int = 0
    # Nobody reads the deltas before the end (a non-streamed answer without stop strings):
    # the text is decoded once, when the request finishes, and nothing is sent before.
    final_only: bool = False
    logprobs_sent: int = 0  # answer tokens whose logprobs went out (requests asking for them)
    # Prompt tokens whose K/V came from the prefix cache (usage.prompt_tokens_details).
    cached_tokens: int = 0

    @property
    def row_length(self) -> int:
        """Tokens this request puts in its next forward (for packing rows into forwards).

        A diffusion canvas is the whole prompt plus canvas every step (less a cached prefix);
        an ISD row is only its pending tokens, drafts and masks, which its state knows.
        """
        if self.state is not None:
            return self.state.row_length
        return len(self.prompt_ids) + self.params.gen_length

    @property
    def is_prefill(self) -> bool:
        """Whether the next row carries the whole prompt (scheduled apart from decode rows)."""
        return self.state is not None and self.state.is_prefill

    def output(
        self,
        delta: str,
        completion_tokens: int,
        finish_reason: str | None,
        error: str | None = None,
        trace: tuple[dict, ...] | None = None,
        logprobs: tuple | None = None,
    ) -> RequestOutput:
        """This request's :class:`RequestOutput` for one step, with its current counters."""
        state = self.state
        return RequestOutput(
            request_id=self.request_id,
            delta_text=delta,
            prompt_tokens=len(self.prompt_ids),
            cached_tokens=self.cached_tokens,
            completion_tokens=completion_tokens,
            nfe=state.nfe if state else 0,
            committed=state.committed if state else 0,
            step=state.step if state else 0,
            block=state.block if state else 0,
            drafted=state.drafted if state else None,
            accepted_drafts=state.accepted_drafts if state else None,
            finished=finish_reason is not None,
            finish_reason=finish_reason,
            error=error,
            trace=trace,
            logprobs=logprobs,
        )
