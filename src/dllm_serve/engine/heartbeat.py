"""Heartbeats between tensor-parallel ranks, so that a rank that is gone is noticed while idle.

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
import os
import threading
import time
from collections.abc import Callable, Sequence

import torch.distributed as dist

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
