"""Waiting and running requests, admission limits, and the grouping of rows into forwards."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from dllm_serve.config import EngineConfig
from dllm_serve.engine.request import Request


class QueueFullError(RuntimeError):
    """The waiting queue is at its limit; the request is refused (HTTP 429)."""


class Scheduler:
    """Owns ``waiting`` (FIFO) and ``running``; engine thread only.

    Every engine iteration advances every running request by exactly one step: rows are grouped
    into forwards of at most ``max_tokens_per_forward`` real tokens (a forward is a flat batch
    with no padding; a single row longer than the budget still gets a forward of its own), and
    a ``force_single_batch`` request gets a forward of its own. Within a forward, rows are
    ordered by length so rows of one shape sit together and share an attention call.
    A request that arrives mid-generation joins the very next iteration, whatever step, block or
    canvas length the others are at; a finished one leaves at once.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def admit(self) -> Iterator[Request]:
        """Yield waiting requests that fit; the caller initialises them and calls :meth:`run`."""
        while self.waiting and len(self.running) < self.config.max_running_requests:
            yield self.waiting.popleft()

    def requeue(self, request: Request) -> None:
        """Put a request :meth:`admit` yielded back at the head of the queue (it must wait)."""
        self.waiting.appendleft(request)

    def run(self, request: Request) -> None:
        self.running.append(request)

    def remove(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def groups(self) -> list[list[Request]]:
        """The forwards of one iteration: every running request exactly once.

        Prefill rows (a self-speculative request's first round: its whole prompt) get forwards
        of their own, so decode rows keep their small fixed shapes and a long prompt does not
        stretch every decode row's step.
        """
        single = [r for r in self.running if r.params.force_single_batch]
        shared = [r for r in self.running if not r.params.force_single_batch]
        groups: list[list[Request]] = [[r] for r in single]
        for prefill in (True, False):
            phase = sorted((r for r in shared if r.is_prefill == prefill), key=_length)
            groups.extend(self._pack(phase))
        return groups

    def _pack(self, rows: list[Request]) -> list[list[Request]]:
        """Consecutive rows into forwards of at most ``max_tokens_per_forward`` real tokens."""
        groups: list[list[Request]] = []
        current: list[Request] = []
        tokens = 0
        budget = self.config.max_tokens_per_forward
        for request in rows:
            length = request.row_length
            if current and tokens + length > budget:
                groups.append(current)
                current, tokens = [], 0
            current.append(request)
            tokens += length
        if current:
            groups.append(current)
        return groups


def _length(request: Request) -> int:
    return request.row_length
