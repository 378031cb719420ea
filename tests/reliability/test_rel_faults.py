"""Faults: clients that vanish at random points, exceptions injected into the engine.

Disconnects run against the shared subprocess server (`rel_server`). The injected exceptions
need the engine in this process: uvicorn serves ``build_app(engine, ServerConfig(...))`` on a
background thread, and the test monkeypatches ``engine.algorithm.update`` (one row's update)
or ``dllm_serve.engine.engine.run_batch`` (one forward). The failing request gets a 500 (an
``error`` event when streamed); the others get exactly the answers they get alone.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import torch
from rel_support import (
    CHAT,
    InProcessServer,
    assert_envelope,
    finished,
    in_process_server,
    sse_events,
    wait_idle,
)
from remote_server import RemoteServer

# ~5 s on 2 idle CPU cores (128 steps took 0.5 s, under 0.4 s of which had run when a client's
# hang-up reached the engine): still running when we leave, on a fast machine too. Every long
# request is abandoned, so its length costs no test time.
LONG = {"max_tokens": 512, "num_denoising_steps": 512}


def request_bytes(body: dict[str, Any]) -> bytes:
    payload = json.dumps(body).encode()
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    return head.encode() + payload


def read_until(sock: socket.socket, marker: bytes, limit_s: float = 20) -> bytes:
    sock.settimeout(limit_s)
    data = b""
    while marker not in data:
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    return data


def body(stream: bool) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "go on"}], "stream": stream, **LONG}


def disconnect(port: int, where: str, rng: random.Random) -> bool:
    """Open a connection, hang up at ``where``; True if the request had reached the engine."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        if where == "before_headers":
            sock.sendall(b"POST /v1/chat/comp")
        elif where == "before_body":
            raw = request_bytes(body(False))
            sock.sendall(raw[: raw.index(b"\r\n\r\n") + 4])
        elif where == "mid_body":
            raw = request_bytes(body(False))
            sock.sendall(raw[: len(raw) - rng.randint(1, 20)])
        elif where == "awaiting_answer":
            sock.sendall(request_bytes(body(False)))
        elif where == "after_role_chunk":
            sock.sendall(request_bytes(body(True)))
            read_until(sock, b'"role": "assistant"')
        elif where == "mid_stream":
            sock.sendall(request_bytes(body(True)))
            read_until(sock, b'"role": "assistant"')
            read_until(sock, b'"content": "')  # a second data event: denoising has begun
        time.sleep(rng.uniform(0, 0.15))
    return where in ("awaiting_answer", "after_role_chunk", "mid_stream")


def test_random_disconnects_leave_the_server_serving(rel_server: RemoteServer) -> None:
    url = rel_server.url
    rng = random.Random(8)
    points = [
        "before_headers",
        "before_body",
        "mid_body",
        "awaiting_answer",
        "after_role_chunk",
        "mid_stream",
    ]
    plan = [rng.choice(points) for _ in range(30)]
    before = finished(url)
    reached = sum(disconnect(rel_server.port, where, rng) for where in plan)
    assert reached > 0
    wait_idle(url)
    deadline = time.monotonic() + 10
    while True:
        delta = {k: v - before.get(k, 0.0) for k, v in finished(url).items()}
        if delta.get("abort", 0) >= reached or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert delta.get("abort", 0) == reached, (delta, plan)
    assert sum(delta.values()) == reached, delta  # nothing else finished, nothing failed
    ok = httpx.post(f"{url}{CHAT}", json={**body(False), "max_tokens": 8}, timeout=30)
    assert ok.status_code == 200
    assert "unhandled error" not in rel_server.log.read_text()


# ---- injected exceptions (in-process server) ----------------------------------------------
@pytest.fixture(scope="module")
def inproc() -> Iterator[InProcessServer]:
    with in_process_server(max_running_requests=8) as server:
        yield server


NORMAL = [
    ({"content": "first question"}, False),
    ({"content": "second question"}, True),
    ({"content": "third question"}, False),
    ({"content": "fourth question"}, True),
]


def chat(content: str, stream: bool, **extra: Any) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": content}],
        "stream": stream,
        "max_tokens": 16,
        "num_denoising_steps": 16,
        **extra,
    }


async def call(http: httpx.AsyncClient, payload: dict[str, Any]) -> tuple[int, Any]:
    response = await http.post(CHAT, json=payload)
    assert response.headers.get("x-request-id")
    if payload["stream"] and response.status_code == 200:
        return 200, sse_events(response.text.splitlines())
    return response.status_code, response


def text_of(status: int, result: Any) -> str:
    assert status == 200
    if isinstance(result, list):
        assert result[-1] == {"done": True} and not any("error" in e for e in result), result
        return "".join(e["choices"][0]["delta"].get("content", "") for e in result[:-1])
    return result.json()["choices"][0]["message"]["content"]


def run_all(url: str, payloads: list[dict[str, Any]]) -> list[tuple[int, Any]]:
    async def main() -> list[tuple[int, Any]]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            return list(await asyncio.gather(*(call(http, p) for p in payloads)))

    return asyncio.run(main())


def poisoned_prompt(server: InProcessServer, content: str) -> list[int]:
    return server.engine.chat_prompt_ids([{"role": "user", "content": content}])


def check_isolated_failure(
    server: InProcessServer, poison: str, extra: dict[str, Any] | None = None
) -> None:
    """Normal requests alone, then with two poisoned ones (plain + streamed) alongside."""
    normal = [chat(m["content"], stream) for m, stream in NORMAL]
    alone = [text_of(*run_all(server.url, [p])[0]) for p in normal]
    before = finished(server.url)
    bad = [chat(poison, False, **(extra or {})), chat(poison, True, **(extra or {}))]
    results = run_all(server.url, [*bad, *normal])
    status, response = results[0]
    assert status == 500, response.text
    error = assert_envelope(response)
    assert error["type"] == "server_error" and "injected" in error["message"]
    status, events = results[1]
    assert status == 200
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    errors = [e["error"] for e in events if "error" in e]
    assert len(errors) == 1 and "injected" in errors[0]["message"], events
    assert errors[0]["type"] == "server_error"
    assert events[-1] == {"done": True}
    assert not any(e.get("choices") and e["choices"][0]["finish_reason"] for e in events[:-1])
    assert [text_of(*r) for r in results[2:]] == alone  # the others are undisturbed
    wait_idle(server.url)
    delta = {k: v - before.get(k, 0.0) for k, v in finished(server.url).items()}
    assert delta.get("error") == 2, delta
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    follow_up = run_all(server.url, [chat("after the fault", False)])[0]
    assert follow_up[0] == 200


def matches(prompt: list[int]) -> Callable[[Any], bool]:
    return lambda t: t.numel() >= len(prompt) and t[: len(prompt)].tolist() == prompt


def test_exception_in_one_rows_update(
    inproc: InProcessServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    poison = "POISON: fail my update"
    is_poisoned = matches(poisoned_prompt(inproc, poison))
    algorithm = inproc.engine.algorithm
    real_commit = algorithm.commit

    def commit(states: Any, rows: Any) -> Any:
        for state in states:
            if state.nfe >= 2 and is_poisoned(state.canvas):  # mid-generation, not at once
                raise RuntimeError("injected update failure")
        return real_commit(states, rows)

    monkeypatch.setattr(algorithm, "commit", commit)
    check_isolated_failure(inproc, poison)


def test_exception_in_a_forward(inproc: InProcessServer, monkeypatch: pytest.MonkeyPatch) -> None:
    poison = "POISON: fail my forward"
    is_poisoned = matches(poisoned_prompt(inproc, poison))
    runner = inproc.engine.runner
    real_run = runner.run
    calls = {"poisoned": 0}

    def run(rows: Any) -> Any:
        if any(is_poisoned(torch.tensor(row.tokens)) for row in rows):
            calls["poisoned"] += 1
            if calls["poisoned"] % 3 == 0:  # a few forwards in
                raise RuntimeError("injected forward failure")
        return real_run(rows)

    monkeypatch.setattr(runner, "run", run)
    # A failed forward fails every row in it (engine contract); force_single_batch keeps the
    # poisoned request in forwards of its own, so only it may fail.
    check_isolated_failure(inproc, poison, {"force_single_batch": True})
