"""What the engine thread does with a step's rows: admit, run, commit, emit, fail, deliver.

A mixin of :class:`~dllm_serve.engine.engine.AsyncEngine` (which owns the attributes these
methods use: the scheduler, the runner, the algorithm, the observer and the outbox); split out
so each file reads as one concept — ``engine.py`` the asyncio-facing facade and the loop,
this file one step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dllm_serve.engine import trace
from dllm_serve.engine.outputs import RequestOutput
from dllm_serve.engine.request import Request

if TYPE_CHECKING:
    from dllm_serve.decoding.algorithm import DecodeState, DecodingAlgorithm
    from dllm_serve.decoding.forward_spec import RowSpec
    from dllm_serve.engine.kv_budget import KVBudget
    from dllm_serve.engine.model_runner import ModelRunner
    from dllm_serve.engine.observer import EngineObserver
    from dllm_serve.engine.scheduler import Scheduler
    from dllm_serve.models.loader import LoadedModel

logger = logging.getLogger("dllm_serve.engine.engine")

Sink = Callable[[RequestOutput], None]


def _deliver(items: list[tuple[Sink, RequestOutput]]) -> None:
    """Runs on the event loop: put each output in its request's queue."""
    for sink, output in items:
        sink(output)


class EngineSteps:
    """One engine step for a group of rows, and what ends a request (engine thread only)."""

    loaded: LoadedModel
    algorithm: DecodingAlgorithm
    runner: ModelRunner
    scheduler: Scheduler
    observer: EngineObserver
    _outbox: dict[asyncio.AbstractEventLoop, list[tuple[Sink, RequestOutput]]]
    _detok_tokenizer: Any
    kv: KVBudget
    _kv_blocked: bool  # the head of the queue waits for KV-pool room, not for a running slot

    def _admit(self) -> None:
        """Start waiting requests, in order, while slots and KV budget allow.

        A request whose worst-case KV does not fit now waits (and so does everyone behind it:
        first come, first served); one that could never fit the whole pool was refused at
        submission (``KVCapacityError``).
        """
        pool = self.runner.pool
        self._kv_blocked = False
        for request in self.scheduler.admit():
            need = self.kv.need(len(request.prompt_ids), request.params)
            span = None
            if need and pool is not None:
                span = pool.allocate(need)
                if span is None:
                    self.scheduler.requeue(request)
                    # Free running slots do not help the queue now: _submit counts it whole.
                    self._kv_blocked = True
                    return
            try:
                request.state = self.algorithm.init_state(
                    request.prompt_ids, request.params, self.loaded.device
                )
            except Exception as exc:
                if span is not None and pool is not None:
                    pool.free(span)
                self._fail_exc(request, exc, "admission")
                continue
            request.state.kv = span
            self.scheduler.run(request)

    def _forward(self, group: list[Request]) -> None:
        """One step for ``group``: prepare → forward → sample → one device→host copy → commit.

        A failure while preparing or committing one row fails only that request; a failure of
        the forward or the batched sampler fails the rows of this forward.
        """
        rows, specs = self._prepare_rows(group)
        if not rows:
            return
        states = [r.state for r in rows]
        # Deliver the previous step's outputs now: the event loop's work on them then overlaps
        # with this forward's kernels (which release the GIL) instead of with host work.
        self._flush()
        try:
            logits = self.runner.run(specs)
            # The step's one device→host copy: every row's commits or verdicts.
            host = self.algorithm.sample(states, logits).tolist()
            self.observer.on_forward(
                len(rows), sum(len(s.tokens) for s in specs), self.runner.forward_seconds()
            )
        except Exception as exc:  # the forward itself: every row of this batch fails
            for request in rows:
                self._fail_exc(request, exc, "forward")
            return
        self._commit_rows(rows, states, host)

    def _prepare_rows(self, group: list[Request]) -> tuple[list[Request], list[RowSpec]]:
        """Each row's tokens and logit positions (the rows whose ``prepare`` succeeded)."""
        rows, specs = [], []
        prepare = self.algorithm.prepare
        for request in group:
            try:
                spec = prepare(request.state)
                # Checked here, per row, so a decoder bug fails its own request only, not
                # every row the batch packer would have refused with it.
                spec.check()
                specs.append(spec)
                rows.append(request)
            except Exception as exc:
                self._fail_exc(request, exc, "prepare")
        return rows, specs

    def _commit_rows(
        self, rows: list[Request], states: list[DecodeState], host: list[list[int]]
    ) -> None:
        """Write each row's result into its state and send what it made final."""
        commit = self.algorithm.commit
        for request, state, row in zip(rows, states, host, strict=True):
            try:
                before = trace.snapshot(state) if request.trace else None
                result = commit([state], [row])[0]
                events = None
                if before is not None:
                    events = (trace.step_event(state, before, self._piece),)
                    if not request.trace_started:
                        request.trace_started = True
                        events = (trace.start_event(state), *events)
                self._emit(
                    request, result.finished, result.finish_reason, result.new_tokens, events
                )
            except Exception as exc:
                self._fail_exc(request, exc, "update")

    def _piece(self, token: int) -> str:
        """One token's text, for trace events (specials included: EOS shows as EOS)."""
        return self._detok_tokenizer.decode([token], skip_special_tokens=False)

    def _emit(
        self,
        request: Request,
        finished: bool,
        finish_reason: str | None,
        new_tokens: int,
        events: tuple[dict, ...] | None = None,
    ) -> None:
        state = request.state
        assert state is not None
        if not finished and events is None:
            if not new_tokens:
                return  # nothing became final: no delta, no decode
            if request.final_only:
                # Nobody reads a delta before the end: decode the answer once, at the end.
                # Its first final token is when content first exists (the metric's moment).
                if request.first_content_time is None:
                    self._first_content(request)
                return
        tokens = state.answer_tokens()
        detok = request.detokenizer
        delta = detok.update(tokens, final=finished)
        count = len(tokens)
        if detok.stopped:  # a stop string ended the answer: tokens after it do not count
            finished, finish_reason = True, "stop"
            count = detok.stop_tokens if detok.stop_tokens is not None else count
        if delta and request.first_content_time is None:
            self._first_content(request)
        if delta or finished or events is not None:
            output = request.output(delta, count, finish_reason if finished else None, None, events)
            self._send(request, output)

    def _first_content(self, request: Request) -> None:
        request.first_content_time = time.monotonic()
        self.observer.on_first_content(request.first_content_time - request.arrival_time)

    def _fail_exc(self, request: Request, exc: Exception, where: str) -> None:
        logger.exception("request failed in %s", where, extra={"request_id": request.request_id})
        self._fail(request, "error", f"{type(exc).__name__}: {exc}")

    def _fail(self, request: Request, reason: str, error: str | None = None) -> None:
        state = request.state
        answer = len(state.answer_tokens()) if state is not None else 0
        self._send(request, request.output("", answer, reason, error))

    def _send(self, request: Request, output: RequestOutput) -> None:
        if output.finished:
            # Free the slot and the KV before the client hears about it, so counts are never
            # stale.
            self.scheduler.remove(request)
            self._release_kv(request)
            self.observer.on_finished(output, time.monotonic() - request.arrival_time)
        if request.loop is None:
            request.sink(output)  # a synchronous consumer (tests, tools)
        else:
            self._outbox.setdefault(request.loop, []).append((request.sink, output))

    def _flush(self) -> None:
        """Hand this step's outputs to their event loops: one wake-up per loop, not per row."""
        outbox, self._outbox = self._outbox, {}
        for loop, items in outbox.items():
            # A closed loop means nobody is listening any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_deliver, items)

    def _release_kv(self, request: Request) -> None:
        state = request.state
        if state is not None and state.kv is not None:
            assert self.runner.pool is not None
            self.runner.pool.free(state.kv)
            state.kv = None
