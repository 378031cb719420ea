"""A failed tensor-parallel group fails the server visibly: /health and new requests answer
503 for the group's grace period, then the process exits with status 1. ``os._exit`` is
stubbed here so that the test process survives; the real processes (a SIGKILL'd worker rank)
are in tests/integration/test_tensor_parallel.py."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
from fastapi.testclient import TestClient

from dllm_serve.api.app import build_app
from dllm_serve.config import ServerConfig
from dllm_serve.engine.engine import AsyncEngine
from dllm_serve.engine.parallel import group as tensor_parallel
from dllm_serve.engine.parallel.group import FAILURE_GRACE_S, TensorParallelGroup
from dllm_serve.models.loader import load_model

GRACE_S = 1.0
REASON = "tensor-parallel worker died: rank 1 (exit code -9)"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


class Exited(Exception):
    """Stands in for the end of the process (os._exit)."""


@pytest.fixture
def exits(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, float]]:
    """(status, time) of every os._exit the module calls."""
    calls: list[tuple[int, float]] = []

    def fake_exit(status: int) -> None:
        calls.append((status, time.monotonic()))
        raise Exited

    monkeypatch.setattr(tensor_parallel.os, "_exit", fake_exit)
    return calls


def test_the_grace_is_short_but_visible() -> None:
    # ≤ 2 s: a failed server must not linger; > 0: a probe must be able to see the 503.
    assert 0 < FAILURE_GRACE_S <= 2


def test_a_failed_rank_answers_503_then_exits_with_status_1(exits) -> None:  # type: ignore[no-untyped-def]
    loaded = load_model("tiny-llada", device="cpu", dtype="float32")
    engine = AsyncEngine(loaded)
    # Attached after the engine is built, so its runner stays single-process (no collectives).
    group = TensorParallelGroup(shard=None, control=None, workers=[], grace_s=GRACE_S)  # type: ignore[arg-type]
    loaded.parallel = group

    def watcher() -> None:
        with contextlib.suppress(Exited):
            group.fail(REASON)

    with TestClient(build_app(engine, ServerConfig())) as client:
        assert client.get("/health").status_code == 200
        failed_at = time.monotonic()
        thread = threading.Thread(target=watcher)
        thread.start()
        deadline = time.monotonic() + 5
        while group.failure is None and time.monotonic() < deadline:
            time.sleep(0.001)
        assert group.failure == REASON
        assert client.get("/health").status_code == 503
        assert client.head("/health").status_code == 503
        reply = client.post("/v1/chat/completions", json=CHAT)
        assert reply.status_code == 503
        assert reply.json()["error"]["code"] == "server_shutting_down"
        assert client.get("/metrics").status_code == 200  # still scrapeable while failing
        assert exits == []  # still within the grace
        # The engine thread's next step on the failed group waits out the same grace (it does
        # not start another) and exits 1 too; the first reason stays.
        with pytest.raises(Exited):
            group.send(("run", []))
        thread.join(5)
    assert not thread.is_alive()
    assert [status for status, _ in exits] == [1, 1]
    assert all(at - failed_at >= GRACE_S for _, at in exits)
    # Soon after the grace, not never: the bound leaves a loaded machine 3 s for the test's
    # own HTTP calls, which run before the engine thread's exit (the grace is a lower bound).
    assert all(at - failed_at < GRACE_S + 3 for _, at in exits)
    assert group.failure == REASON
