"""How requests enter the engine and leave it early: submit, abort, the waiting limit.

A mixin of :class:`~dllm_serve.engine.engine.AsyncEngine` (which owns the attributes these
methods use: the lock and inbox the engine thread reads, the scheduler, the KV budget); every
method here may run on any thread, under the engine's lock where it touches shared state.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from itertools import islice
from typing import TYPE_CHECKING, Any

import uuid6

from dllm_serve.config import EngineConfig
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.engine.algorithms import check_request
from dllm_serve.engine.outputs import IncrementalDetokenizer, RequestOutput
from dllm_serve.engine.request import Request
from dllm_serve.engine.scheduler import QueueFullError, Scheduler
from dllm_serve.engine.steps import Sink

if TYPE_CHECKING:
    from dllm_serve.decoding.algorithm import DecodingAlgorithm
    from dllm_serve.engine.kv_budget import KVBudget
    from dllm_serve.models.loader import LoadedModel


class EngineDeadError(RuntimeError):
    """The engine thread stopped; no request can be served."""


class EngineSubmission:
    """Submitting and aborting requests (any thread)."""

    loaded: LoadedModel
    config: EngineConfig
    algorithm: DecodingAlgorithm
    scheduler: Scheduler
    kv: KVBudget
    num_waiting: int
    _cond: threading.Condition
    _inbox: deque[Request]
    _aborts: set[str]
    _abort_all_reason: str | None
    _stopping: bool
    _dead: BaseException | None
    _thread: threading.Thread
    _kv_blocked: bool
    _decode: Callable[[Sequence[int]], str]

    def generate(
        self,
        prompt_ids: list[int],
        params: DecodingParams,
        request_id: str | None = None,
        **options: Any,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Submit a request now and return the async iterator of its outputs (``options``:
        those of :meth:`submit`). Closing the iterator before the last output aborts the
        request."""
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        request_id = self.submit(
            prompt_ids, params, queue.put_nowait, request_id, loop=loop, **options
        )
        return self._outputs(request_id, queue)

    def submit(
        self,
        prompt_ids: list[int],
        params: DecodingParams,
        sink: Sink,
        request_id: str | None = None,
        *,
        stop: Sequence[str] = (),
        timeout: float | None = None,
        trace: bool = False,
        final_only: bool = False,
        include_stop: bool = False,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> str:
        """Submit a request now: ``sink`` receives each of its outputs, the last one with
        ``finished`` set, on ``loop`` (:meth:`generate`) or, without one, on the engine thread
        itself (a synchronous consumer such as the offline LLM; it must return at once).
        Returns the request id (for :meth:`abort`).

        Submission is eager, so a full queue raises :class:`QueueFullError` (and a stopped
        engine :class:`EngineDeadError`) here. With ``timeout`` (seconds), the request ends
        with ``finish_reason == "timeout"`` at the first step boundary past it. ``trace``:
        every step's output carries its trace event (engine/trace.py). ``include_stop``: the
        answer ends *after* the stop string it matched, not before (vLLM's
        ``include_stop_str_in_output``); the token count is the same either way.
        ``final_only`` (a caller that only joins the deltas): the answer is decoded once and
        arrives whole in the last output, with no output before it, so no step pays for
        detokenising or a hand-off. It has no effect with ``stop`` strings (matched step by
        step, so a stop string ends decoding early) or ``trace``.
        """
        check_request(self.algorithm, self.loaded.name, params)
        request = Request(
            request_id=request_id or str(uuid6.uuid7()),
            prompt_ids=list(prompt_ids),
            params=params,
            sink=sink,
            detokenizer=IncrementalDetokenizer(
                self._decode, stop=tuple(stop), include_stop=include_stop
            ),
            loop=loop,
            trace=trace,
            final_only=final_only and not stop and not trace,
        )
        if timeout is not None:
            request.deadline = request.arrival_time + timeout
        self._submit(request)
        return request.request_id

    async def _outputs(
        self, request_id: str, queue: asyncio.Queue[RequestOutput]
    ) -> AsyncGenerator[RequestOutput, None]:
        finished = False
        try:
            while not finished:
                output = await queue.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.abort(request_id)

    @contextlib.contextmanager
    def submitting_together(self) -> Iterator[None]:
        """Requests submitted inside this block reach the engine thread together, so its next
        step admits them all (a batch that arrived one by one would start with a step of one
        row and take an extra forward). Holds the engine's lock: submit and leave quickly."""
        with self._cond:
            yield

    def _submit(self, request: Request) -> None:
        self.kv.check(len(request.prompt_ids), request.params)
        with self._cond:
            if self._dead is not None or self._stopping or not self._thread.is_alive():
                raise EngineDeadError("the engine is not running")
            # Counting this request too, so a limit of 0 means "no queue", not "no requests".
            waiting = self.num_waiting + 1 - self._starting(request)
            if waiting > self.config.max_waiting_requests:
                raise QueueFullError(
                    f"{waiting - 1} request(s) already waiting "
                    f"(limit {self.config.max_waiting_requests})"
                )
            self._inbox.append(request)
            self._cond.notify_all()

    def _starting(self, request: Request) -> int:
        """How many of the queue (``request`` last) the next admission pass can start: as many
        as there are free running slots, in order, while their K/V fits the free pool. So a
        burst that reaches an idle engine counts as waiting as soon as the pool holds it back,
        not only after an admission pass has seen it blocked (found by QA)."""
        free_slots = self.config.max_running_requests - len(self.scheduler.running)
        if self._kv_blocked or free_slots <= 0:
            return 0
        # A snapshot of the head only (``islice`` runs in C, so the engine thread, which pops
        # from ``waiting`` without this lock, cannot change it midway).
        head = [*islice(self.scheduler.waiting, free_slots), *islice(self._inbox, free_slots)]
        return self.kv.startable([*head, request][:free_slots])

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its row and state are freed before the next step."""
        with self._cond:
            self._aborts.add(request_id)
            self._cond.notify_all()

    def abort_all(self, reason: str) -> None:
        """Abort every queued and running request (shutdown); each gets ``reason`` as error."""
        with self._cond:
            self._abort_all_reason = reason
            self._cond.notify_all()
