"""Rank 0's handle on a tensor-parallel group, and the heartbeats that tell it a rank is gone.

Failure of any rank fails the server visibly: rank 0 watches the workers' processes, and
when one ends unexpectedly (or a control message cannot be sent) it logs which rank died,
marks the group failed — the API then answers 503 to /health and to new requests — and
exits with status 1 after :data:`FAILURE_GRACE_S`, so that a load balancer's probe sees the
503 rather than only a closed port. A worker whose rank 0 is gone sees its control channel
close and exits. Nothing waits forever.

**Heartbeats.**
The control channel only carries messages when there is work: rank 0 sends each step's rows,
and every rank then runs the step's collectives. An idle group sends nothing, so losing a rank
goes unnoticed there. This covers a rank started by a launcher on another node, which rank 0
cannot watch as a child process, and also a rank that is frozen or whose node dropped off the
network. Each rank would notice only at the next request, or never: a worker waits on its
control channel indefinitely.

So every rank runs a thread that bumps its own counter in the group's key-value store (the
``TCPStore`` at ``MASTER_ADDR:MASTER_PORT`` that ``torch.distributed`` rendezvous uses) every
:data:`BEAT_S`, and reads the counters it watches. Rank 0 watches every worker and each worker
watches rank 0. A watched counter that has not moved for :data:`STALE_S`, or a store that does
not answer for :data:`STORE_TIMEOUT_S`, counts as a lost rank. Rank 0 then fails the server
visibly (503, then exit status 1) and a worker exits with status 1. The counters live in a
store of their own, apart from the collectives, so a long forward or a slow model load, which
keep the main thread busy, never delay a beat.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any, NoReturn

import torch.distributed as dist

from dllm_serve.models.sharding import TPShard

logger = logging.getLogger(__name__)

STOP = "stop"
REDUCE = "reduce"  # control message: run this VocabOp on the last step's logits
# How long a failed server keeps answering 503 before it exits: long enough for a probe or a
# retrying client to see it, short enough that the orchestrator restarts the pod promptly.
FAILURE_GRACE_S = 2.0


@dataclass
class VocabTraffic:
    """What the sampler's reductions brought to rank 0: ``collectives`` gathers,
    ``reduced_positions`` positions reduced to statistics, ``dense_rows`` rows gathered whole,
    ``bytes`` received from the other ranks."""

    collectives: int = 0
    reduced_positions: int = 0
    dense_rows: int = 0
    bytes: int = 0


@dataclass
class TensorParallelGroup:
    """Rank 0's handle on the group: the control channel and the worker processes."""

    shard: TPShard
    control: Any
    workers: list[Any]
    # Why the group failed (set once by :meth:`fail`); the API answers 503 while it is set.
    failure: str | None = None
    grace_s: float = FAILURE_GRACE_S
    heartbeat: Heartbeat | None = None
    # What the vocab-parallel sampler brought to rank 0, all steps together.
    traffic: VocabTraffic = field(default_factory=VocabTraffic)
    _stopping: bool = False
    _watcher: threading.Thread | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _exit_at: float = 0.0

    def send(self, message: tuple) -> None:
        """A control message to every worker (rank 0 only); on a failed group, or when the
        message cannot be sent (a rank is gone), the server fails (:meth:`fail`)."""
        if self.failure is not None:  # no new step on a group that lost a rank
            self.fail(self.failure)
        try:
            dist.broadcast_object_list([message], src=0, group=self.control)
        except (RuntimeError, OSError) as exc:
            self.fail(f"tensor-parallel collective failed: {exc}")

    def fail(self, reason: str) -> NoReturn:
        """Mark the group failed, log ``reason`` once, and exit the process with status 1
        after :attr:`grace_s` (counted from the first call; later callers, e.g. the engine
        thread after the watcher, wait only what is left of it)."""
        with self._lock:
            if self.failure is None:
                self.failure = reason
                self._exit_at = time.monotonic() + self.grace_s
                logger.critical(
                    "%s; answering 503 and exiting with status 1 in %.1f s", reason, self.grace_s
                )
        time.sleep(max(0.0, self._exit_at - time.monotonic()))
        # os._exit skips multiprocessing's clean-up of its children: a frozen worker would
        # outlive the server, holding its GPU memory.
        kill_workers(self.workers)
        os._exit(1)

    def watch(self) -> None:
        """Fail the server (:meth:`fail`) as soon as a worker dies unexpectedly."""

        def run() -> None:
            ready = wait([p.sentinel for p in self.workers])
            if self._stopping:
                return
            # A sentinel closes while the process exits, a moment before waitpid can report
            # it: join the ended ones briefly so their exit codes are known.
            ended = [(i, p) for i, p in enumerate(self.workers) if p.sentinel in ready]
            for _, process in ended:
                process.join(timeout=1.0)
            dead = [f"rank {i + 1} (exit code {p.exitcode})" for i, p in ended]
            self.fail("tensor-parallel worker died: " + ", ".join(dead))

        self._watcher = threading.Thread(target=run, name="dllm-tp-watch", daemon=True)
        self._watcher.start()

    def lost(self, reason: str) -> None:
        """A rank stopped beating (the heartbeats below): fail, unless shutting down."""
        if not self._stopping:
            self.fail(reason)

    def stop(self, timeout: float = 10.0) -> None:
        if self._stopping:
            return
        self._stopping = True
        if self.heartbeat is not None:
            self.heartbeat.stop()
        try:  # not self.send: a worker gone at shutdown must not turn a clean exit into 1
            dist.broadcast_object_list([(STOP,)], src=0, group=self.control)
        except Exception:  # a worker already gone: nothing to tell it
            logger.warning("could not send stop to the tensor-parallel workers", exc_info=True)
        # One deadline for all: joined one after another with ``timeout`` each, seven hung
        # workers would hold the exit for 70 s, past the pod's grace period.
        deadline = time.monotonic() + timeout
        for p in self.workers:
            p.join(max(0.0, deadline - time.monotonic()))
        kill_workers(self.workers)
        dist.destroy_process_group()


def kill_workers(workers: list[Any]) -> None:
    """SIGKILL every worker still running (a stopped or frozen one too)."""
    for p in workers:
        if p.is_alive():
            p.kill()


# ---- heartbeats --------------------------------------------------------------------------------


BEAT_S = 0.5  # how often each rank bumps its counter
STALE_S = 5.0  # a watched counter that has not moved for this long: that rank is gone
STORE_TIMEOUT_S = 5.0  # a store that does not answer for this long: rank 0's side is gone
_PREFIX = "dllm_serve/heartbeat/"


def store_address(init_method: str) -> tuple[str, int]:
    """Host and port of the group's TCPStore: from ``tcp://host:port``, or for ``env://`` from
    ``MASTER_ADDR`` / ``MASTER_PORT`` (under torchrun: its agent's store)."""
    if init_method.startswith("tcp://"):
        host, _, port = init_method.removeprefix("tcp://").rpartition(":")
        return host, int(port)
    return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])


class Heartbeat:
    """This rank's beat and its watch over ``watched`` ranks; ``on_lost(reason)`` is called
    (from the heartbeat thread) once a watched rank is gone. It is not expected to return:
    rank 0 fails the server, a worker exits."""

    def __init__(
        self,
        rank: int,
        watched: Sequence[int],
        address: tuple[str, int],
        on_lost: Callable[[str], object],
        *,
        beat_s: float = BEAT_S,
        stale_s: float = STALE_S,
    ) -> None:
        self.rank = rank
        self.watched = tuple(watched)
        self.on_lost = on_lost
        self.beat_s, self.stale_s = beat_s, stale_s
        host, port = address
        timeout = datetime.timedelta(seconds=STORE_TIMEOUT_S)
        # A client connection of its own: its timeout bounds only the heartbeat's calls.
        self._store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        self._stop = threading.Event()
        self._reported = False
        self._report_lock = threading.Lock()
        # A store call on a frozen host blocks without end (the client's timeout covers only
        # connecting and waiting for keys), so a second thread watches the first one's pace.
        self._last_round = time.monotonic()
        self._threads = [
            threading.Thread(target=self._beat, name="dllm-tp-heartbeat", daemon=True),
            threading.Thread(target=self._watchdog, name="dllm-tp-heartbeat-watch", daemon=True),
        ]

    def start(self) -> Heartbeat:
        self._last_round = time.monotonic()
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        """Stop beating and watching (a clean shutdown: the other ranks are stopping too)."""
        self._stop.set()

    def _beat(self) -> None:
        seen: dict[int, tuple[int, float]] = {}  # rank -> (last count, when it last moved)
        while not self._stop.is_set():
            try:
                self._store.add(f"{_PREFIX}{self.rank}", 1)
                now = time.monotonic()
                for rank in self.watched:
                    count = self._store.add(f"{_PREFIX}{rank}", 0)  # a read that never waits
                    if rank not in seen or seen[rank][0] != count:
                        seen[rank] = (count, now)
                    elif now - seen[rank][1] > self.stale_s:
                        self._lost(f"rank {rank} sent no heartbeat for {self.stale_s:g} s")
                        return
            except Exception as exc:  # the store (hosted with rank 0) is gone
                self._lost(f"the group's store at rank 0 does not answer ({exc})")
                return
            self._last_round = time.monotonic()
            self._stop.wait(self.beat_s)

    def _watchdog(self) -> None:
        while not self._stop.wait(self.beat_s) and not self._reported:
            silent = time.monotonic() - self._last_round
            if silent > STORE_TIMEOUT_S:
                self._lost(
                    f"the group's store at rank 0 does not answer (no reply for {silent:.0f} s)"
                )
                return

    def _lost(self, reason: str) -> None:
        """Report once (either thread may find the loss), never after a clean stop."""
        with self._report_lock:
            if self._stop.is_set() or self._reported:
                return
            self._reported = True
        self.on_lost(f"tensor-parallel heartbeat lost: {reason}")
