"""Helpers of the reliability suite: envelope checks, metrics, RSS, an in-process server."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

CHAT = "/v1/chat/completions"
REL_BODY_LIMIT = 512 * 1024  # --max-request-bytes of the shared input-test server
REL_REQUEST_TIMEOUT_S = 5  # its --request-timeout: bounds any fuzzed request that is valid
ENVELOPE_KEYS = {"message", "type", "param", "code"}


def assert_envelope(response: httpx.Response, context: object = "") -> dict[str, Any]:
    """A non-2xx answer: OpenAI error envelope and an X-Request-ID header; returns the error."""
    assert response.headers.get("x-request-id"), (response.status_code, context)
    body = response.json()
    assert set(body) == {"error"}, (body, context)
    error = body["error"]
    assert set(error) == ENVELOPE_KEYS, (error, context)
    assert isinstance(error["message"], str) and error["message"], (error, context)
    assert isinstance(error["type"], str), (error, context)
    assert error["param"] is None or isinstance(error["param"], str), (error, context)
    assert error["code"] is None or isinstance(error["code"], str), (error, context)
    return error


def metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics, keyed by (name, sorted labels)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def metric(url: str, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return metrics(url).get(key, 0.0)


def finished(url: str) -> dict[str, float]:
    """dllm:request_success_total by finished_reason."""
    return {
        dict(labels)["finished_reason"]: value
        for (name, labels), value in metrics(url).items()
        if name == "dllm:request_success_total"
    }


def wait_idle(url: str, timeout: float = 15.0) -> None:
    """Until running and waiting gauges are both 0 (asserts they get there)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        running = m.get(("dllm:num_requests_running", ()), -1)
        waiting = m.get(("dllm:num_requests_waiting", ()), -1)
        if running == 0 and waiting == 0:
            return
        assert time.monotonic() < deadline, f"not idle: running={running} waiting={waiting}"
        time.sleep(0.05)


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def sse_events(lines: Iterator[str]) -> list[dict[str, Any]]:
    """`data:` lines of an SSE stream as dicts; `[DONE]` becomes {"done": True}."""
    import json

    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append({"done": True} if data == "[DONE]" else json.loads(data))
    return events


@dataclass
class InProcessServer:
    """uvicorn serving ``build_app(engine, config)`` on a background thread of this process."""

    engine: Any
    server: uvicorn.Server
    thread: threading.Thread
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextmanager
def in_process_server(**engine_limits: int) -> Iterator[InProcessServer]:
    from dllm_serve.api.app import build_app
    from dllm_serve.config import EngineConfig, ServerConfig
    from dllm_serve.engine.engine import AsyncEngine
    from dllm_serve.models.loader import load_model

    loaded = load_model("tiny-llada", device="cpu", dtype="float32")
    engine_config = EngineConfig(**engine_limits)
    engine = AsyncEngine(loaded, engine_config)
    port = free_port()
    app = build_app(engine, ServerConfig(host="127.0.0.1", port=port, engine=engine_config))
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", http="h11", loop="asyncio"
    )  # as the CLI does
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn-in-process", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "in-process server did not start"
        time.sleep(0.02)
    try:
        yield InProcessServer(engine, server, thread, port)
    finally:
        server.should_exit = True
        thread.join(30)
