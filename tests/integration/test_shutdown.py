"""SIGTERM: drain in-flight requests, refuse new ones with 503, exit 0 (peers never exit)."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
from remote_server import RemoteServer

MESSAGES = [{"role": "user", "content": "Keep going."}]


def stream_events(url: str, body: dict, events: list[dict], started: threading.Event) -> None:
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{url}/v1/chat/completions", json=body) as response,
    ):
        for line in response.iter_lines():
            if line.startswith("data: "):
                started.set()
                data = line[len("data: ") :]
                events.append({"done": True} if data == "[DONE]" else json.loads(data))


def test_sigterm_lets_inflight_stream_finish_then_exits_zero(tmp_path: Path) -> None:
    server = RemoteServer.start(["--shutdown-timeout", "30"], tmp_path / "log")
    events: list[dict] = []
    started = threading.Event()
    # ~5 s on 2 idle CPU cores: still streaming while the checks below run, even when the
    # server takes a while to start draining on a loaded machine.
    body = {"messages": MESSAGES, "stream": True, "max_tokens": 512, "num_denoising_steps": 512}
    thread = threading.Thread(target=stream_events, args=(server.url, body, events, started))
    thread.start()
    assert started.wait(30)
    server.process.send_signal(signal.SIGTERM)
    with httpx.Client(timeout=5) as http:
        deadline = time.monotonic() + 5  # the drain starts on the server's event loop
        while http.get(f"{server.url}/health").status_code != 503:  # readiness fails
            assert time.monotonic() < deadline, "/health still ready 5 s after SIGTERM"
            time.sleep(0.02)
        refused = http.post(f"{server.url}/v1/chat/completions", json={"messages": MESSAGES})
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "server_shutting_down"
    thread.join(60)
    assert server.process.wait(30) == 0
    finishes = [e for e in events if e.get("choices") and e["choices"][0]["finish_reason"]]
    assert finishes and finishes[0]["choices"][0]["finish_reason"] in ("stop", "length")
    assert events[-1] == {"done": True}
    assert not any("error" in e for e in events)


def test_sigterm_aborts_what_outlives_the_timeout_with_an_error_event(tmp_path: Path) -> None:
    server = RemoteServer.start(["--shutdown-timeout", "0.5"], tmp_path / "log")
    events: list[dict] = []
    started = threading.Event()
    body = {
        "messages": MESSAGES,
        "stream": True,
        "max_tokens": 1024,
        "num_denoising_steps": 512,
        "block_length": 2,
    }
    thread = threading.Thread(target=stream_events, args=(server.url, body, events, started))
    thread.start()
    assert started.wait(30)
    server.process.send_signal(signal.SIGTERM)
    thread.join(60)
    assert server.process.wait(30) == 0
    errors = [e["error"] for e in events if "error" in e]
    assert len(errors) == 1 and "shutting down" in errors[0]["message"]
    assert events[-1] == {"done": True}
