"""The uvicorn server with a graceful drain on SIGTERM/SIGINT.

First signal: stop taking work (new API requests and /health get 503, so readiness probes fail
and load balancers move away), let in-flight requests finish for up to ``shutdown_timeout``
seconds, abort whatever is left (streams get an ``error`` event, others a 503), then let
uvicorn close connections and run the lifespan shutdown. The process exits 0.

A second signal ends the wait: whatever is still running is aborted now, with the same errors,
and the shutdown goes on as above (the engine thread is stopped before the process exits, so
no torch work is cut off mid-kernel). A third signal exits at once, with status 1.

An engine that stops for good (a device fault; every request has had its final error by then)
makes the server answer 503 for :data:`FAILURE_GRACE_S`, so that probes see it, then shut
down; ``serving.serve`` exits with status 1.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import time
from collections.abc import Callable
from types import FrameType

import uvicorn
from sse_starlette.sse import AppStatus

from dllm_serve.engine.engine import AsyncEngine

logger = logging.getLogger(__name__)

# sse-starlette would end every open stream at the first signal; we drain them ourselves.
AppStatus.disable_automatic_graceful_drain()
# How long a server whose engine died keeps answering 503 before it exits.
FAILURE_GRACE_S = 2.0


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first exit signal drains in-flight requests first."""

    def __init__(
        self,
        config: uvicorn.Config,
        engine: AsyncEngine,
        lifecycle: object,
        timeout: float,
        on_started: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(config)
        self.engine = engine
        self.lifecycle = lifecycle
        self.drain_timeout = timeout
        # Called once the server listens (the start-up log's last line).
        self.on_started = on_started
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signals = 0
        self._hurry = asyncio.Event()  # set by the second signal: stop waiting, abort now

    async def serve(self, sockets: list | None = None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets: list | None = None) -> None:  # type: ignore[override]
        await super().startup(sockets)
        if self.started and self.on_started is not None:
            self.on_started()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in uvicorn's _captured_signals: re-raising SIGTERM after a clean drain
        # would kill the process with the signal instead of exiting 0.
        loop = self._loop
        if loop is None:  # before the server runs there is nothing to drain
            self.should_exit = True
            AppStatus.should_exit = True
            return
        self._signals += 1
        if self._signals == 1:
            # A fresh context: the signal may interrupt a request's task, whose request id
            # would otherwise be inherited by every drain log line.
            loop.call_soon_threadsafe(
                lambda: asyncio.ensure_future(self._drain()), context=contextvars.Context()
            )
        elif self._signals == 2:
            logger.warning("shutdown: second signal, aborting in-flight requests now")
            loop.call_soon_threadsafe(self._hurry.set)
        else:
            # uvicorn's own force exit would skip the lifespan shutdown and leave the engine
            # thread inside torch while the interpreter finalises (a C++ abort): exit instead.
            logger.warning("shutdown: third signal, exiting now")
            logging.shutdown()
            os._exit(1)

    def engine_died(self, exc: BaseException) -> None:
        """Engine thread: the engine stopped for good. Shut the server down (it can serve
        nothing), after a short grace in which every request and probe gets a 503."""
        loop = self._loop
        if loop is None:  # not serving yet: nothing to answer
            self.should_exit = True
            return
        loop.call_soon_threadsafe(
            lambda: asyncio.ensure_future(self._fail(exc)), context=contextvars.Context()
        )

    async def _fail(self, exc: BaseException) -> None:
        logger.critical(
            "the engine stopped (%s); answering 503 and exiting with status 1 in %.1f s",
            exc, FAILURE_GRACE_S,
        )  # fmt: skip
        self.lifecycle.draining = True  # type: ignore[attr-defined]
        await asyncio.sleep(FAILURE_GRACE_S)
        AppStatus.should_exit = True
        self.should_exit = True

    async def _drain(self) -> None:
        self.lifecycle.draining = True  # type: ignore[attr-defined]
        busy = self.engine.num_running + self.engine.num_waiting
        logger.info("shutdown: draining %d request(s), up to %.1fs", busy, self.drain_timeout)
        deadline = time.monotonic() + self.drain_timeout
        while self._busy() and time.monotonic() < deadline and not self._hurry.is_set():
            await asyncio.sleep(0.05)
        if self._busy():
            logger.warning("shutdown: aborting %d request(s) still running", self._busy())
            self.engine.abort_all("the server is shutting down")
            until = time.monotonic() + 5
            while self._busy() and time.monotonic() < until:
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # let the last responses and error events reach clients
        AppStatus.should_exit = True
        self.should_exit = True

    def _busy(self) -> int:
        return self.engine.num_running + self.engine.num_waiting
