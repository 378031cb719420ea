"""Bodies are parsed off the event loop (found by QA: validating a 4 MB list of messages took
~2 s on the loop, during which /health and every other connection waited)."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

import dllm_serve.api.pipeline as pipeline
from dllm_serve.api.app import build_app
from dllm_serve.engine.engine import AsyncEngine
from dllm_serve.models.loader import load_model


@pytest.fixture(scope="module")
def app():  # type: ignore[no-untyped-def]
    return build_app(AsyncEngine(load_model("tiny-llada", device="cpu", dtype="float32")))


def post(app, path: str, body: dict) -> httpx.Response:  # type: ignore[no-untyped-def]
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, content=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip

    return asyncio.run(go())


@pytest.mark.parametrize(
    ("path", "parser", "field"),
    [("/v1/chat/completions", "parse_chat_request", "messages"),
     ("/v1/completions", "parse_completion_request", "prompt")],
)  # fmt: skip
def test_every_body_is_parsed_in_a_worker_thread(
    app,
    monkeypatch: pytest.MonkeyPatch,
    path: str,
    parser: str,
    field: str,  # type: ignore[no-untyped-def]
) -> None:
    original = getattr(pipeline, parser)
    threads: list[threading.Thread] = []

    def recording(*args: object, **kwargs: object) -> object:
        threads.append(threading.current_thread())
        return original(*args, **kwargs)

    monkeypatch.setattr(pipeline, parser, recording)
    for text in ("hi", "a" * (1 << 16)):
        value = [{"role": "user", "content": text}] if field == "messages" else text
        # An unknown field: refused by the parser itself, whichever thread it runs in.
        response = post(app, path, {field: value, "max_tokens": 4, "bogus": 1})
        assert response.status_code == 400
        assert response.json()["error"]["message"].startswith(
            "Unrecognized request argument supplied: bogus"
        )
    loop_thread = threading.current_thread()  # asyncio.run runs the app's loop here
    assert len(threads) == 2 and loop_thread not in threads
