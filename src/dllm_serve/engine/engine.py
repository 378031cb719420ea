"""AsyncEngine: the asyncio-facing engine and the one thread that owns the model.

The event loop only enqueues requests, awaits their outputs and aborts them; every forward
pass runs on the engine thread, so ``/health`` and other requests never wait for a step.
The loop reads: admit → for each running request: prepare → forward → update → emit → free.
Requests are interleaved step by step (a new request starts at the next step, a finished one
leaves at once); fusing their rows into one batched forward comes with the batching work.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence

import torch
import uuid6

from dllm_serve.config import EngineConfig
from dllm_serve.decoding.denoise import LLaDADenoiser
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.engine.outputs import IncrementalDetokenizer, RequestOutput
from dllm_serve.engine.request import Request, RequestStatus
from dllm_serve.models.loader import LoadedModel

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped; no request can be served."""


class AsyncEngine:
    """submit → async stream of :class:`RequestOutput`, abort, shutdown."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        self.loaded = loaded
        self.config = config or EngineConfig()
        self.algorithm = LLaDADenoiser(loaded.mask_id, loaded.stop_ids)
        self._cond = threading.Condition()
        self._inbox: deque[Request] = deque()
        self._aborts: set[str] = set()
        self._stopping = False
        self._dead: BaseException | None = None
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._tokenizer_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="dllm-engine", daemon=True)

    # ---- lifecycle -------------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.loaded.name

    @property
    def max_length(self) -> int:
        return self.loaded.max_length

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._dead is None and not self._stopping

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- tokenizer (called from worker threads of the event loop) ----------------------------
    def chat_prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        with self._tokenizer_lock:
            return self.loaded.chat_prompt_ids(messages)

    def _decode(self, ids: Sequence[int]) -> str:
        with self._tokenizer_lock:
            return self.loaded.decode(list(ids))

    # ---- requests --------------------------------------------------------------------------
    async def generate(
        self, prompt_ids: list[int], params: DecodingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs; closing the iterator early aborts it."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def sink(output: RequestOutput) -> None:
            # A closed loop means nobody is listening any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(queue.put_nowait, output)

        request = Request(
            request_id=request_id or str(uuid6.uuid7()),
            prompt_ids=list(prompt_ids),
            params=params,
            sink=sink,
            detokenizer=IncrementalDetokenizer(self._decode),
        )
        with self._cond:
            if self._dead is not None or self._stopping or not self._thread.is_alive():
                raise EngineDeadError("the engine is not running")
            self._inbox.append(request)
            self._cond.notify_all()
        finished = False
        try:
            while not finished:
                output = await queue.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its row and state are freed before the next step."""
        with self._cond:
            self._aborts.add(request_id)
            self._cond.notify_all()

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + len(self._inbox)

    # ---- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            with torch.inference_mode():
                while self._loop_once():
                    pass
        except BaseException as exc:  # a bug in the loop itself: fail everyone, report dead
            logger.exception("engine loop died")
            self._dead = exc
        finally:
            reason = "engine stopped" if self._dead is None else f"engine died: {self._dead!r}"
            with self._cond:
                pending = [*self._inbox, *self._waiting, *self._running]
                self._inbox.clear()
                self._waiting.clear()
                self._running.clear()
            for request in pending:
                self._finish(request, "error", error=reason)

    def _loop_once(self) -> bool:
        with self._cond:
            while not (
                self._stopping or self._inbox or self._aborts or self._running or self._waiting
            ):
                self._cond.wait()
            if self._stopping:
                return False
            self._waiting.extend(self._inbox)
            self._inbox.clear()
            aborts, self._aborts = self._aborts, set()
        self._apply_aborts(aborts)
        self._admit()
        for request in list(self._running):
            self._step(request)
        self._running = [r for r in self._running if r.status is RequestStatus.RUNNING]
        return True

    def _has_work(self) -> bool:
        return bool(self._stopping or self._inbox or self._aborts or self._running or self._waiting)

    def _apply_aborts(self, aborts: set[str]) -> None:
        if not aborts:
            return
        for queue_ in (self._waiting, self._running):
            for request in [r for r in queue_ if r.request_id in aborts]:
                queue_.remove(request)
                self._finish(request, "abort")

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.config.max_running_requests:
            request = self._waiting.popleft()
            try:
                request.state = self.algorithm.init_state(
                    request.prompt_ids, request.params, self.loaded.device
                )
            except Exception as exc:
                logger.exception("request %s failed at admission", request.request_id)
                self._finish(request, "error", error=f"{type(exc).__name__}: {exc}")
                continue
            request.status = RequestStatus.RUNNING
            self._running.append(request)

    def _step(self, request: Request) -> None:
        state = request.state
        assert state is not None
        try:
            spec = self.algorithm.prepare(state)
            hidden = self.loaded.model(spec.input_ids[None], spec.positions[None], None)
            logits = self.loaded.model.lm_head(hidden[0, spec.logits_index])
            result = self.algorithm.update(state, logits)
        except Exception as exc:  # this row only: the other requests keep going
            logger.exception("request %s failed in a step", request.request_id)
            self._finish(request, "error", error=f"{type(exc).__name__}: {exc}")
            return
        tokens = state.answer_tokens()
        delta = request.detokenizer.update(tokens, final=result.finished)
        if delta and request.first_content_time is None:
            request.first_content_time = time.monotonic()
        if result.finished:
            request.status = RequestStatus.FINISHED
        if delta or result.finished:
            request.sink(
                self._output(request, delta, result.finish_reason if result.finished else None)
            )

    def _finish(self, request: Request, reason: str, error: str | None = None) -> None:
        request.status = RequestStatus.FINISHED
        request.sink(self._output(request, "", reason, error=error, finished=True))

    def _output(
        self,
        request: Request,
        delta: str,
        finish_reason: str | None,
        error: str | None = None,
        finished: bool | None = None,
    ) -> RequestOutput:
        state = request.state
        return RequestOutput(
            request_id=request.request_id,
            delta_text=delta,
            prompt_tokens=len(request.prompt_ids),
            completion_tokens=len(state.answer_tokens()) if state else 0,
            nfe=state.nfe if state else 0,
            step=state.step if state else 0,
            block=state.block if state else 0,
            finished=finish_reason is not None if finished is None else finished,
            finish_reason=finish_reason,
            error=error,
        )
