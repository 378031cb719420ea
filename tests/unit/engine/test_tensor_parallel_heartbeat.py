"""Heartbeats in the group's TCPStore (engine/parallel/group.py): a rank whose counter stops
moving, or a store that stops answering, is reported lost once, with the rank named; ranks
that keep beating never are, and a stopped heartbeat reports nothing. Real TCPStores on
loopback, short intervals; the processes themselves are in
tests/integration/test_tensor_parallel.py."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from dllm_serve.engine.parallel.group import STORE_TIMEOUT_S, Heartbeat, store_address

BEAT_S, STALE_S = 0.1, 1.0


class Lost:
    """Records on_lost calls; ``event`` is set at the first."""

    def __init__(self) -> None:
        self.reasons: list[tuple[str, float]] = []
        self.event = threading.Event()

    def __call__(self, reason: str) -> None:
        self.reasons.append((reason, time.monotonic()))
        self.event.set()


@pytest.fixture
def master() -> dist.TCPStore:
    """The group's store, as rank 0's process hosts it (port chosen by the OS)."""
    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=5),
        wait_for_workers=False,
    )  # fmt: skip


def beat(rank: int, watched: list[int], master: dist.TCPStore, lost: Lost) -> Heartbeat:
    return Heartbeat(
        rank, watched, ("127.0.0.1", master.port), lost, beat_s=BEAT_S, stale_s=STALE_S
    ).start()


def three_ranks(master: dist.TCPStore, lost0: Lost, lost12: Lost) -> list[Heartbeat]:
    """Rank 0 watching ranks 1 and 2, which watch rank 0 (reporting to ``lost12``)."""
    return [beat(0, [1, 2], master, lost0), beat(1, [0], master, lost12),
            beat(2, [0], master, lost12)]  # fmt: skip


def test_ranks_that_keep_beating_are_never_lost(master: dist.TCPStore) -> None:
    lost0, lost1 = Lost(), Lost()
    rank0, rank1, rank2 = three_ranks(master, lost0, lost1)
    time.sleep(3 * STALE_S)
    for hb in (rank0, rank1, rank2):
        hb.stop()
    assert lost0.reasons == [] and lost1.reasons == []


def test_a_rank_that_stops_beating_is_lost_once_and_named(master: dist.TCPStore) -> None:
    lost0, lost1 = Lost(), Lost()
    rank0, rank1, rank2 = three_ranks(master, lost0, lost1)
    time.sleep(2 * BEAT_S)
    rank2._stop.set()  # rank 2 freezes: no more beats (and no clean stop of the others)
    frozen = time.monotonic()
    assert lost0.event.wait(STALE_S + 10 * BEAT_S + 2)
    time.sleep(3 * BEAT_S)  # no second report: the watching thread has ended
    [(reason, at)] = lost0.reasons
    assert reason == "tensor-parallel heartbeat lost: rank 2 sent no heartbeat for 1 s"
    assert at - frozen >= STALE_S - 2 * BEAT_S  # its last beat may precede the freeze
    assert lost1.reasons == []  # rank 0 still beats: the workers are fine
    rank0.stop()
    rank1.stop()


@pytest.mark.parametrize(
    ("sig", "why"),
    [
        (signal.SIGKILL, "("),
        # Slow (`pytest -m slow`): waits out the heartbeat timeout; keeps the suite near 10 min.
        pytest.param(signal.SIGSTOP, "(no reply for ", marks=pytest.mark.slow),
    ],  # dead: the socket closes
    ids=["killed", "frozen"],  # frozen: the socket stays open and never answers
)
def test_a_worker_whose_store_is_gone_is_lost(sig: int, why: str) -> None:
    # Rank 0's process hosts the store: here a process of its own, stopped as rank 0 would be.
    host = subprocess.Popen(
        [sys.executable, "-c", STORE_HOST], stdout=subprocess.PIPE, text=True
    )  # fmt: skip
    try:
        assert host.stdout is not None
        port = int(host.stdout.readline())
        lost = Lost()
        worker = Heartbeat(1, [0], ("127.0.0.1", port), lost, beat_s=BEAT_S, stale_s=60)
        worker.start()
        time.sleep(2 * BEAT_S)
        os.kill(host.pid, sig)
        gone = time.monotonic()
        assert lost.event.wait(STORE_TIMEOUT_S + 5)
        [(reason, at)] = lost.reasons
        assert reason.startswith(
            "tensor-parallel heartbeat lost: the group's store at rank 0 does not answer " + why
        ), reason
        assert at - gone <= STORE_TIMEOUT_S + 3  # the watchdog wakes late on a loaded machine
        worker.stop()
    finally:
        host.kill()
        host.wait(10)


STORE_HOST = """
import datetime, time, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=5))
print(store.port, flush=True)
time.sleep(120)
"""


def test_a_stopped_heartbeat_reports_nothing(master: dist.TCPStore) -> None:
    lost0 = Lost()
    rank0 = beat(0, [1], master, lost0)
    rank1 = beat(1, [0], master, Lost())
    rank0.stop()  # a clean shutdown: rank 0 stops watching before the workers leave
    rank1.stop()
    time.sleep(STALE_S + 4 * BEAT_S)
    assert lost0.reasons == []


def test_store_address_from_the_init_method(monkeypatch: pytest.MonkeyPatch) -> None:
    assert store_address("tcp://127.0.0.1:29500") == ("127.0.0.1", 29500)
    monkeypatch.setenv("MASTER_ADDR", "node-0.svc")
    monkeypatch.setenv("MASTER_PORT", "29400")
    assert store_address("env://") == ("node-0.svc", 29400)
