"""Server options that need no network: CORS off unless configured, --log-requests."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from dllm_serve.api.app import build_app
from dllm_serve.config import ServerConfig
from dllm_serve.engine.engine import AsyncEngine
from dllm_serve.models.loader import load_model

PREFLIGHT = {
    "Origin": "https://app.example.com",
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "content-type",
}


@pytest.fixture(scope="module")
def loaded():  # type: ignore[no-untyped-def]
    return load_model("tiny-llada", device="cpu", dtype="float32")


def call(app, method: str, path: str, **kwargs: object) -> httpx.Response:  # type: ignore[no-untyped-def]
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(go())


def test_cors_is_off_unless_origins_are_configured(loaded) -> None:  # type: ignore[no-untyped-def]
    closed = build_app(AsyncEngine(loaded), ServerConfig())
    response = call(closed, "OPTIONS", "/v1/chat/completions", headers=PREFLIGHT)
    assert "access-control-allow-origin" not in response.headers

    opened = build_app(AsyncEngine(loaded), ServerConfig(cors_origins=("https://app.example.com",)))
    response = call(opened, "OPTIONS", "/v1/chat/completions", headers=PREFLIGHT)
    assert response.headers["access-control-allow-origin"] == "https://app.example.com"
    other = call(
        opened, "OPTIONS", "/v1/chat/completions", headers={**PREFLIGHT, "Origin": "https://evil"}
    )
    assert "access-control-allow-origin" not in other.headers


def test_cors_allows_the_js_sdks_headers_and_covers_every_answer(loaded) -> None:  # type: ignore[no-untyped-def]
    app = build_app(AsyncEngine(loaded), ServerConfig(cors_origins=("https://app.example.com",)))
    # The openai JS SDK's preflight names its own headers (found by QA: 400 before).
    sdk = "authorization,content-type,x-stainless-os,x-stainless-lang,x-stainless-retry-count"
    headers = {**PREFLIGHT, "Access-Control-Request-Headers": sdk}
    response = call(app, "OPTIONS", "/v1/chat/completions", headers=headers)
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == "https://app.example.com"
    # HEAD is answered wherever GET is, so a page may send it with a key (found by QA: its
    # preflight was refused).
    head = {**headers, "Access-Control-Request-Method": "HEAD"}
    assert call(app, "OPTIONS", "/v1/models", headers=head).status_code == 200
    # An answer made by an outer middleware (a bad X-Request-ID) is readable by the page too.
    bad = {"Origin": "https://app.example.com", "X-Request-ID": "x" * 300}
    response = call(app, "POST", "/v1/chat/completions", headers=bad, json={})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_request_id"
    assert response.headers["access-control-allow-origin"] == "https://app.example.com"


def test_log_requests_logs_prompt_and_answer_only_when_asked(
    loaded, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    body = {"messages": [{"role": "user", "content": "secret-prompt-42"}], "max_tokens": 8}
    for enabled in (False, True):
        engine = AsyncEngine(loaded)
        engine.start()
        app = build_app(engine, ServerConfig(log_requests=enabled))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="dllm_serve"):
            response = call(app, "POST", "/v1/chat/completions", json=body)
        engine.shutdown()
        assert response.status_code == 200
        logged = "\n".join(r.getMessage() for r in caplog.records)
        assert ("secret-prompt-42" in logged) is enabled
        assert ("answer=" in logged) is enabled


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"stream": True}),
        ("/v1/completions", {"stream": True, "prompt": "secret-prompt-42"}),
        ("/v1/completions", {"prompt": "secret-prompt-42"}),
        ("/v1/dllm/trace", {}),
    ],
    ids=["chat-stream", "completion-stream", "completion-json", "trace"],
)
def test_log_requests_logs_every_route_and_streamed_answers(
    loaded, caplog: pytest.LogCaptureFixture, path: str, body: dict
) -> None:  # type: ignore[no-untyped-def]
    # Found by QA: only a non-streamed chat answer was logged, the trace endpoint not at all.
    if "prompt" not in body:
        body = {**body, "messages": [{"role": "user", "content": "secret-prompt-42"}]}
    engine = AsyncEngine(loaded)
    engine.start()
    app = build_app(engine, ServerConfig(log_requests=True))
    with caplog.at_level(logging.INFO, logger="dllm_serve"):
        response = call(app, "POST", path, json={**body, "max_tokens": 8})
    engine.shutdown()
    assert response.status_code == 200
    logged = [r.getMessage() for r in caplog.records]
    assert sum("secret-prompt-42" in line for line in logged) == 1
    answers = [line for line in logged if line.startswith("answer=")]
    assert len(answers) == 1 and answers[0].endswith("finish_reason=length"), answers


def test_log_requests_logs_stop_strings(loaded, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    # Found by QA: a request's stop strings were missing, so it could not be replayed.
    engine = AsyncEngine(loaded)
    engine.start()
    app = build_app(engine, ServerConfig(log_requests=True))
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stop": ["zz"]}
    with caplog.at_level(logging.INFO, logger="dllm_serve"):
        assert call(app, "POST", "/v1/chat/completions", json=body).status_code == 200
    engine.shutdown()
    assert any("stop=('zz',)" in r.getMessage() for r in caplog.records)


def test_a_path_cannot_forge_a_log_line(loaded, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    """Found by QA: a percent-encoded line break in the path of a rejected request started a
    log line of the client's choosing (the path is logged decoded). Control characters are
    written escaped; a traceback still gets its own lines."""
    from dllm_serve.logs import configure_logging

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_logging("info", "text")  # its handler writes to the captured stderr
        app = build_app(AsyncEngine(loaded), ServerConfig())
        forged = "/x%0a2026-12-02 14:00:00,000 WARNING [-] dllm_serve: FORGED%0d%1b[2J"
        response = call(app, "GET", forged, headers={"X-Request-ID": "bad id"})
        assert response.status_code == 400
        try:
            raise ValueError("boom")
        except ValueError:
            logging.getLogger("dllm_serve.test").exception("failed\non purpose")
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
    lines = capsys.readouterr().err.splitlines()
    rejected = [line for line in lines if "rejected" in line]
    assert len(rejected) == 1, lines
    assert "/x\\n2026-12-02 14:00:00,000 WARNING [-] dllm_serve: FORGED\\r\\x1b[2J" in rejected[0]
    assert not any(line.startswith("2026-12-02 14:00:00") for line in lines)
    failed = next(i for i, line in enumerate(lines) if "failed\\non purpose" in line)
    assert lines[failed + 1] == "Traceback (most recent call last):"


def test_the_log_escape_keeps_spaces_and_escapes_controls() -> None:
    from dllm_serve.logs import escape_controls

    assert escape_controls("café\xa0日本\u3000x") == "café\xa0日本\u3000x"
    assert escape_controls("a\nb\u2028c\x1b[2J\td") == "a\\nb\\u2028c\\x1b[2J\\td"
