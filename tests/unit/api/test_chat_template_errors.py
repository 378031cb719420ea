"""A conversation the checkpoint's chat template cannot render is a 400, not a 500 (found by
QA: a checkpoint without a chat template answered every chat request with a server error)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from dllm_serve.api.app import build_app
from dllm_serve.config import ServerConfig
from dllm_serve.engine.engine import AsyncEngine
from dllm_serve.models.loader import load_model
from dllm_serve_train.tiny_checkpoints import write_tiny_llada

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}


def serve(path: Path, body_path: str, body: dict) -> httpx.Response:
    engine = AsyncEngine(load_model(str(path), device="cpu", dtype="float32"))
    engine.start()
    app = build_app(engine, ServerConfig())

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(body_path, json=body)

    try:
        return asyncio.run(go())
    finally:
        engine.shutdown()


def with_template(tmp_path: Path, template: str | None) -> Path:
    path = write_tiny_llada(tmp_path / "tiny")
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    if template is not None:
        config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    (path / "chat_template.jinja").unlink(missing_ok=True)
    return path


@pytest.mark.parametrize("stream", [False, True])
def test_no_chat_template_is_a_400_on_chat(tmp_path: Path, stream: bool) -> None:
    path = with_template(tmp_path, None)
    response = serve(path, "/v1/chat/completions", {**CHAT, "stream": stream})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages" and "has no chat template" in error["message"]
    assert "/v1/completions" in error["message"]
    # A raw prompt needs no template.
    assert serve(path, "/v1/completions", {"prompt": "Hi", "max_tokens": 8}).status_code == 200


def test_a_template_that_refuses_the_messages_is_a_400(tmp_path: Path) -> None:
    template = "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
    response = serve(with_template(tmp_path, template), "/v1/chat/completions", CHAT)
    assert response.status_code == 400
    assert "Conversation roles must alternate" in response.json()["error"]["message"]
