"""A request whose worst-case K/V exceeds the whole KV pool is a 400 before it is queued
(found by QA: it was a 500 server_error, which SDKs retry, and only once it reached the head
of the queue); one that fits still runs."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from dllm_serve.api.app import build_app
from dllm_serve.config import EngineConfig, ServerConfig
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.engine.engine import AsyncEngine
from dllm_serve.llm import LLM, InvalidRequestError
from dllm_serve.models.kv_pool import KVPool
from dllm_serve.models.loader import load_model

SLOTS = 128  # whole pages of 16


def test_a_request_larger_than_the_kv_pool_is_a_400() -> None:
    loaded = load_model("demo-idlm", device="cpu", dtype="float32")
    cfg = loaded.model.config
    per_slot = KVPool.bytes_per_slot(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, loaded.dtype)
    engine = AsyncEngine(loaded, EngineConfig(kv_cache_memory=SLOTS * per_slot / 2**30))
    assert engine.runner.pool is not None and engine.runner.pool.slots == SLOTS
    question = {"messages": [{"role": "user", "content": "What is 2 + 2?"}]}
    with TestClient(build_app(engine, ServerConfig())) as client:
        refused = client.post("/v1/chat/completions", json={**question, "max_tokens": 200})
        ok = client.post("/v1/chat/completions", json={**question, "max_tokens": 16})
        metrics = client.get("/metrics").text
    assert refused.status_code == 400
    error = refused.json()["error"]
    prompt = ok.json()["usage"]["prompt_tokens"]
    need = engine.algorithm.kv_tokens(prompt, DecodingParams(gen_length=200, steps=200))
    assert error == {
        "message": f"This server cannot run the request: the request needs {need} KV-cache "
        "slots (its prompt, max tokens and decoding scratch), but the KV cache holds "
        f"{SLOTS}. Please reduce the length of the prompt or the completion (the server's "
        "operator can raise --kv-cache-memory).",
        "type": "invalid_request_error",
        "param": "max_tokens",
        "code": "context_length_exceeded",
    }
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "2 + 2 = 4"
    assert 'dllm:requests_rejected_total{reason="context_length_exceeded"} 1.0' in metrics


def test_the_offline_chat_refuses_it_as_the_server_does() -> None:
    loaded = load_model("demo-idlm", device="cpu", dtype="float32")
    cfg = loaded.model.config
    per_slot = KVPool.bytes_per_slot(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, loaded.dtype)
    config = EngineConfig(kv_cache_memory=SLOTS * per_slot / 2**30)
    with LLM.from_loaded(loaded, config) as llm:
        with pytest.raises(InvalidRequestError) as refused:
            llm.chat([[{"role": "user", "content": "What is 2 + 2?"}]], max_tokens=200)
        [ok] = llm.chat([[{"role": "user", "content": "What is 2 + 2?"}]], max_tokens=16)
    assert (refused.value.param, refused.value.code) == ("max_tokens", "context_length_exceeded")
    assert f"but the KV cache holds {SLOTS}" in str(refused.value)
    assert ok.text == "2 + 2 = 4"
