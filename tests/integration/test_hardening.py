"""Production behaviour through a real server: auth, body limit, timeouts, stop, logs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from remote_server import RemoteServer

KEY = "sk-test-123"
MESSAGES = [{"role": "user", "content": "Say something long."}]


@pytest.fixture(scope="module")
def hardened(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    log = tmp_path_factory.mktemp("hardened") / "server.log"
    args = ["--api-key", KEY, "--max-request-bytes", "4000", "--request-timeout", "3"]
    srv = RemoteServer.start([*args, "--log-format", "json", "--log-level", "info"], log)
    yield srv
    srv.stop()


def client(server: RemoteServer, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)


def test_api_key_required_on_api_routes_only(hardened: RemoteServer) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        client(hardened, "wrong").chat.completions.create(model="x", messages=MESSAGES)
    assert info.value.status_code == 401
    assert info.value.body["code"] == "invalid_api_key"
    assert info.value.body["message"] == (
        "Incorrect API key provided. Send it as 'Authorization: Bearer <key>'."
    )
    assert info.value.response.headers["x-request-id"]
    ok = client(hardened).chat.completions.create(model="x", messages=MESSAGES, max_tokens=8)
    assert ok.choices[0].finish_reason in ("stop", "length")
    with httpx.Client(base_url=hardened.url, timeout=10) as http:
        missing = http.get("/v1/models")
        assert missing.status_code == 401
        assert missing.json()["error"] == {
            "message": "No API key provided. Send it as 'Authorization: Bearer <key>'.",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
        for path in ("/health", "/metrics", "/version"):
            assert http.get(path).status_code == 200, path


def test_oversized_body_gets_413(hardened: RemoteServer) -> None:
    big = {"messages": [{"role": "user", "content": "x" * 5000}]}
    with httpx.Client(base_url=hardened.url, timeout=10) as http:
        response = http.post(
            "/v1/chat/completions", json=big, headers={"Authorization": f"Bearer {KEY}"}
        )
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "request_too_large"
        assert response.headers["x-request-id"]

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted while reading
            data = json.dumps(big).encode()
            for i in range(0, len(data), 1000):
                yield data[i : i + 1000]

        chunked = http.post(
            "/v1/chat/completions",
            content=chunks(),
            headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        )
        assert chunked.status_code == 413


def test_request_timeout_aborts_and_tells_the_client(hardened: RemoteServer) -> None:
    # ~10 s on 2 idle CPU cores, so it cannot finish inside the 3 s limit; the limit itself
    # leaves the fixture's 8-token requests (0.2 s with 8 busy loops beside the server) room.
    slow = {"max_tokens": 1024, "extra_body": {"num_denoising_steps": 512, "block_length": 2}}
    with pytest.raises(openai.APIStatusError) as info:
        client(hardened).chat.completions.create(model="x", messages=MESSAGES, **slow)
    assert info.value.status_code == 504
    assert info.value.body["code"] == "request_timeout"
    with pytest.raises(openai.APIError) as streamed:
        for _ in client(hardened).chat.completions.create(
            model="x", messages=MESSAGES, stream=True, **slow
        ):
            pass
    assert "time limit" in streamed.value.message


def test_logs_are_json_with_the_request_id(hardened: RemoteServer) -> None:
    client(hardened).chat.completions.create(
        model="x", messages=MESSAGES, max_tokens=8, extra_headers={"X-Request-ID": "log-me-42"}
    )
    lines = [json.loads(line) for line in Path(hardened.log).read_text().splitlines() if line]
    assert all({"ts", "level", "logger", "request_id", "message"} <= set(e) for e in lines)
    assert any(e["request_id"] == "log-me-42" for e in lines)
    assert not any("Say something long" in e["message"] for e in lines)  # no --log-requests


def test_stop_string_ends_answer_streamed_and_not(server: RemoteServer) -> None:
    c = server.client()
    common = {"model": "x", "messages": MESSAGES, "max_tokens": 32}
    full = c.chat.completions.create(**common).choices[0].message.content
    assert len(full) >= 6
    stop = full[3:6]
    cut = full[: full.index(stop)]
    plain = c.chat.completions.create(**common, stop=[stop])
    assert plain.choices[0].message.content == cut
    assert plain.choices[0].finish_reason == "stop"
    chunks = list(c.chat.completions.create(**common, stop=stop, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == cut
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
