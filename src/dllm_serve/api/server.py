"""The uvicorn server with a graceful drain on SIGTERM/SIGINT.

First signal: stop taking work (new API requests and /health get 503, so readiness probes fail
and load balancers move away), let in-flight requests finish for up to ``shutdown_timeout``
seconds, abort whatever is left (streams get an ``error`` event, others a 503), then let
uvicorn close connections and run the lifespan shutdown. The process exits 0. A second signal
exits at once.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from types import FrameType

import uvicorn
from sse_starlette.sse import AppStatus

from dllm_serve.engine.engine import AsyncEngine

logger = logging.getLogger(__name__)

# sse-starlette would end every open stream at the first signal; we drain them ourselves.
AppStatus.disable_automatic_graceful_drain()


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first exit signal drains in-flight requests first."""

    def __init__(
        self, config: uvicorn.Config, engine: AsyncEngine, lifecycle: object, timeout: float
    ) -> None:
        super().__init__(config)
        self.engine = engine
        self.lifecycle = lifecycle
        self.drain_timeout = timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def serve(self, sockets: list | None = None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in uvicorn's _captured_signals: re-raising SIGTERM after a clean drain
        # would kill the process with the signal instead of exiting 0.
        if self._draining or self._loop is None:
            self.should_exit = self.force_exit = True
            AppStatus.should_exit = True
            return
        self._draining = True
        # A fresh context: the signal may interrupt a request's task, whose request id would
        # otherwise be inherited by every drain log line.
        self._loop.call_soon_threadsafe(
            lambda: asyncio.ensure_future(self._drain()), context=contextvars.Context()
        )

    async def _drain(self) -> None:
        self.lifecycle.draining = True  # type: ignore[attr-defined]
        busy = self.engine.num_running + self.engine.num_waiting
        logger.info("shutdown: draining %d request(s), up to %.1fs", busy, self.drain_timeout)
        deadline = time.monotonic() + self.drain_timeout
        while self._busy() and time.monotonic() < deadline:
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
