"""Admission: how requests reach the engine thread, which of them run, and what each reserves
in the KV pool.

- :class:`Inbox` — the hand-off from other threads (submissions, aborts) to the engine thread.
- :class:`Scheduler` — ``waiting`` (FIFO) and ``running``; every iteration it picks the rows
  of this step's forwards.
- :class:`KVBudget` — what a request reserves in the KV pool when it starts: the pages of its
  worst case (``kv_tokens`` of its algorithm), taken physically as its context grows. One whose
  worst case is larger than the whole pool could never run, so it is refused when it is
  submitted (:class:`KVCapacityError`, an HTTP 400) rather than failing when it reaches the
  head of the queue.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from dllm_serve.config import EngineConfig
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.decoding.protocol import DecodingAlgorithm
from dllm_serve.engine.model_runner import ModelRunner
from dllm_serve.engine.request import Request
from dllm_serve.models.kv_pool import PAGE_SIZE, KVPool
from dllm_serve.models.loader import LoadedModel


class Inbox:
    """Requests and aborts on their way to the engine thread: the one piece of engine state
    that other threads write, under one lock.

    Any thread :meth:`put` s a request or :meth:`abort` s one; the engine thread :meth:`take` s
    everything at the start of an iteration, waiting while there is nothing to do.
    """

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.requests: deque[Request] = deque()
        self._aborts: set[str] = set()
        self._abort_all: str | None = None
        self.stopping = False

    def put(self, request: Request) -> None:
        """Hand ``request`` to the engine thread (the caller holds :attr:`lock`)."""
        self.requests.append(request)
        self.lock.notify_all()

    def abort(self, request_id: str) -> None:
        with self.lock:
            self._aborts.add(request_id)
            self.lock.notify_all()

    def abort_all(self, reason: str) -> None:
        with self.lock:
            self._abort_all = reason
            self.lock.notify_all()

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
            self.lock.notify_all()

    def take(self, scheduler: Scheduler) -> Aborts | None:
        """Move new requests into ``scheduler.waiting`` and return the aborts to apply, waiting
        until there is work (running or waiting requests count); None once stopping."""
        with self.lock:
            while not (
                self.stopping
                or self.requests
                or self._aborts
                or self._abort_all
                or scheduler.running
                or scheduler.waiting
            ):
                self.lock.wait()
            if self.stopping:
                return None
            scheduler.waiting.extend(self.requests)
            self.requests.clear()
            aborts = Aborts(self._aborts, self._abort_all)
            self._aborts, self._abort_all = set(), None
            return aborts

    def drain(self, scheduler: Scheduler) -> list[Request]:
        """Every request not finished, taken out of the inbox and the scheduler (the engine
        thread's last act: each gets a final error)."""
        with self.lock:
            pending = [*self.requests, *scheduler.waiting, *scheduler.running]
            self.requests.clear()
            scheduler.waiting.clear()
            scheduler.running.clear()
        return pending


@dataclass(frozen=True, slots=True)
class Aborts:
    """What one iteration must end early: these request ids, or everyone (``all``: why)."""

    ids: set[str]
    all: str | None


# ---- waiting and running -----------------------------------------------------------------------


# How many later requests may start before a request that waits for KV pages at the head of
# the queue: small requests are not held up by a large one, and the large one does not starve.
MAX_BYPASS = 16


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


# ---- KV budget ---------------------------------------------------------------------------------


class KVCapacityError(ValueError):
    """The request's worst-case K/V is larger than the whole KV pool: it could never run."""


def pool_slots(loaded: LoadedModel, config: EngineConfig, algorithm: DecodingAlgorithm) -> int:
    """Slots of the engine's KV pool (0: the algorithm keeps no K/V): room for every running
    request at the longest context, unless ``--kv-cache-memory`` (or free memory) says less."""
    longest = algorithm.kv_tokens(loaded.max_length - 1, DecodingParams(gen_length=1))
    if not longest:
        if config.kv_cache_memory is not None:  # a flag that would do nothing is refused
            raise ValueError(
                f"model {loaded.name!r} keeps no KV cache, so it has no use for "
                "--kv-cache-memory (LLaDA and Dream keep one with --kv-cache prefix); omit the flag"
            )
        return 0
    # Whole pages: each request reserves its worst case rounded up to pages.
    most = config.max_running_requests * _whole_pages(longest)
    slots = ModelRunner.pool_slots(loaded.model, loaded.device, config.kv_cache_memory, most)
    slots -= slots % PAGE_SIZE
    # The smallest request (one prompt token, one answer token, the decoding's scratch): a
    # pool that cannot hold it would start healthy and refuse every request.
    smallest = algorithm.kv_tokens(1, DecodingParams(gen_length=1))
    if slots < _whole_pages(smallest):
        raise ValueError(
            f"--kv-cache-memory leaves room for {slots} KV slots (pages of {PAGE_SIZE}), fewer "
            f"than the smallest request needs ({smallest}: one prompt token, one answer token "
            "and the decoding's scratch)"
        )
    return slots


def _whole_pages(tokens: int) -> int:
    """``tokens`` rounded up to whole pages."""
    return -(-tokens // PAGE_SIZE) * PAGE_SIZE


@dataclass(frozen=True, slots=True)
class KVBudget:
    """What requests reserve in ``pool`` (None: nothing is reserved)."""

    pool: KVPool | None
    algorithm: DecodingAlgorithm

    @property
    def reserved_bytes(self) -> int:
        """Bytes of the pool reserved by running requests (0 when idle or without a pool);
        read from other threads (metrics scrape): one integer read under the GIL."""
        if self.pool is None:
            return 0
        return self.pool.reserved_pages * self.pool.page_size * self.bytes_per_slot

    @property
    def bytes_per_slot(self) -> int:
        return 0 if self.pool is None else self.pool.nbytes // self.pool.slots

    def need(self, prompt_tokens: int, params: DecodingParams) -> int:
        """Slots a request reserves when it starts (0 without a pool)."""
        if self.pool is None:
            return 0
        return self.algorithm.kv_tokens(prompt_tokens, params)

    def check(self, prompt_tokens: int, params: DecodingParams) -> None:
        """Raise :class:`KVCapacityError` for a request the whole pool cannot hold."""
        need = self.need(prompt_tokens, params)
        if self.pool is not None and self.pool.pages_for(need) > self.pool.num_pages:
            raise KVCapacityError(
                f"the request needs {need} KV-cache slots (its prompt, max tokens and decoding "
                f"scratch), but the KV cache holds {self.pool.slots}"
            )

    def startable(self, queue: Sequence[Request]) -> int:
        """How many of ``queue``, in order, the unreserved pages can hold (pages need not be
        contiguous, so this is exactly what admission will find)."""
        if self.pool is None:
            return len(queue)
        room, starting = self.pool.free_pages, 0
        for request in queue:
            room -= self.pool.pages_for(self.need(len(request.prompt_ids), request.params))
            if room < 0:
                break
            starting += 1
        return starting
