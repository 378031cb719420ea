"""SIGTERM while several streams and a plain request are in flight (subprocess server).

Every in-flight request ends cleanly: a stream either finishes (finish chunk, [DONE]) or gets
exactly one ``error`` event and [DONE]; the plain request gets its answer or a 503 in the
envelope. The process exits 0 within the drain timeout plus a margin. A second SIGTERM ends
the drain's wait: the requests still running get the same errors at once.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from rel_support import CHAT, assert_envelope, metric, sse_events
from remote_server import RemoteServer

SHORT = {"max_tokens": 8, "num_denoising_steps": 8}  # finishes well inside the drain
# 512 forwards over a 1024-token canvas: ~10 s alone on 2 CPU cores and ~4x that with four such
# rows sharing forwards, so it outlives the drain (256 forwards no longer did once forwards
# became flat and fused). The short rows share those forwards: 8 steps took 0.4 s after the
# signal on an idle machine and 2.1 s with 8 busy loops beside it, so a 2 s drain failed under
# load; 8 s leaves them ~4x of that and the long rows still ~5x short of finishing.
LONG = {"max_tokens": 1024, "num_denoising_steps": 512, "block_length": 2}
DRAIN_S = 8.0


def stream(url: str, extra: dict[str, Any], out: list[Any], started: threading.Event) -> None:
    payload = {"messages": [{"role": "user", "content": "go"}], "stream": True, **extra}
    lines: list[str] = []
    try:
        with (
            httpx.Client(timeout=60) as http,
            http.stream("POST", f"{url}{CHAT}", json=payload) as response,
        ):
            assert response.status_code == 200
            for line in response.iter_lines():
                lines.append(line)
                if line.startswith("data: "):
                    started.set()
        out.append(sse_events(lines))
    except Exception as exc:  # reported by the test, not swallowed
        out.append(exc)
        started.set()


def plain(url: str, out: list[Any], started: threading.Event) -> None:
    payload = {"messages": [{"role": "user", "content": "go"}], **LONG}
    started.set()
    try:
        out.append(httpx.post(f"{url}{CHAT}", json=payload, timeout=60))
    except Exception as exc:
        out.append(exc)


def wait_running(url: str, count: int, timeout: float = 30.0) -> None:
    """Until the engine runs ``count`` requests (asserts it gets there)."""
    deadline = time.monotonic() + timeout
    while metric(url, "dllm:num_requests_running") < count:
        assert time.monotonic() < deadline, f"fewer than {count} requests running"
        time.sleep(0.02)


# Slow (excluded by default; `pytest -m slow`): keeps the default suite near 10 minutes on 2 cores.
@pytest.mark.slow
def test_sigterm_during_streaming_ends_every_request_cleanly(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    server = RemoteServer.start(["--shutdown-timeout", str(DRAIN_S)], log)
    kinds = ["short", "long", "short", "long", "short", "long"]
    results: list[list[Any]] = [[] for _ in kinds]
    threads, gates = [], []
    for kind, out in zip(kinds, results, strict=True):
        gate = threading.Event()
        extra = SHORT if kind == "short" else LONG
        threads.append(threading.Thread(target=stream, args=(server.url, extra, out, gate)))
        gates.append(gate)
    plain_out: list[Any] = []
    plain_gate = threading.Event()
    threads.append(threading.Thread(target=plain, args=(server.url, plain_out, plain_gate)))
    gates.append(plain_gate)
    # The long requests (and the plain one) first, until the engine runs all four: the plain
    # request has no event to wait for, and one submitted after the signal would get a 503
    # "shutting down" instead of the aborted answer this test is about.
    order = [i for i, kind in enumerate(kinds) if kind == "long"] + [len(kinds)]
    for i in order:
        threads[i].start()
    wait_running(server.url, len(order))
    for i in range(len(threads)):
        if i not in order:
            threads[i].start()
    assert all(gate.wait(30) for gate in gates)
    signalled = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    for thread in threads:
        thread.join(60)
    assert server.process.wait(30) == 0
    assert time.monotonic() - signalled < DRAIN_S + 15

    for kind, (events,) in zip(kinds, results, strict=True):
        assert isinstance(events, list), events
        assert events[-1] == {"done": True}, events
        errors = [e["error"] for e in events if "error" in e]
        finishes = [e for e in events if e.get("choices") and e["choices"][0].get("finish_reason")]
        assert len(errors) + len(finishes) == 1, events  # exactly one terminal event
        if kind == "short":
            assert finishes, events
            assert finishes[0]["choices"][0]["finish_reason"] in ("stop", "length")
        else:
            assert errors and "shutting down" in errors[0]["message"], errors
            assert set(errors[0]) == {"message", "type", "param", "code"}
    (response,) = plain_out
    assert isinstance(response, httpx.Response), response
    if response.status_code != 200:
        assert response.status_code == 503
        assert assert_envelope(response)["code"] == "request_aborted"
    text = log.read_text()
    assert "unhandled error" not in text and "Traceback" not in text, text[-3000:]
    json.dumps(results, default=str)  # results are plain data (nothing left half-read)


def wait_draining(url: str, timeout: float = 10.0) -> None:
    """Until /health answers 503 (the first signal's drain has begun)."""
    deadline = time.monotonic() + timeout
    while httpx.get(f"{url}/health", timeout=5).status_code != 503:
        assert time.monotonic() < deadline, "the drain did not start"
        time.sleep(0.02)


def test_a_second_sigterm_aborts_in_flight_requests_now(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    # A drain this long would outlast the test: only the second signal can end it in time.
    server = RemoteServer.start(["--shutdown-timeout", "120"], log)
    results: list[list[Any]] = [[], []]
    gates = [threading.Event(), threading.Event(), threading.Event()]
    threads = [
        threading.Thread(target=stream, args=(server.url, LONG, results[i], gates[i]))
        for i in range(2)
    ]
    plain_out: list[Any] = []
    threads.append(threading.Thread(target=plain, args=(server.url, plain_out, gates[2])))
    for thread in threads:
        thread.start()
    wait_running(server.url, 3)
    assert all(gate.wait(30) for gate in gates)
    server.process.send_signal(signal.SIGTERM)
    wait_draining(server.url)
    signalled = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    for thread in threads:
        thread.join(60)
    assert server.process.wait(30) == 0
    assert time.monotonic() - signalled < 20  # not the 120 s drain

    for (events,) in results:
        assert isinstance(events, list), events
        assert events[-1] == {"done": True}, events
        errors = [e["error"] for e in events if "error" in e]
        assert len(errors) == 1 and "shutting down" in errors[0]["message"], events
    (response,) = plain_out
    assert isinstance(response, httpx.Response), response
    assert response.status_code == 503
    assert assert_envelope(response)["code"] == "request_aborted"
    text = log.read_text()
    assert "second signal" in text
    assert "Traceback" not in text and "Exception in ASGI" not in text, text[-3000:]
