"""usage has the same fields streamed and not (self-speculation counters only where they apply)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from dllm_serve.api.app import build_app
from dllm_serve.config import ServerConfig
from dllm_serve.engine.engine import AsyncEngine
from dllm_serve.models.loader import load_model

ISD_FIELDS = {"drafted_tokens", "accepted_drafts", "acceptance_rate"}


@pytest.mark.parametrize(("model", "speculative"), [("tiny-llada", False), ("demo-idlm", True)])
def test_usage_is_the_same_streamed_and_not(model: str, speculative: bool) -> None:
    engine = AsyncEngine(load_model(model, device="cpu", dtype="float32"))
    body = {"messages": [{"role": "user", "content": "What is 1 + 2?"}], "max_tokens": 8}
    with TestClient(build_app(engine, ServerConfig())) as client:
        plain = client.post("/v1/chat/completions", json=body).json()
        stream = client.post(
            "/v1/chat/completions",
            json={**body, "stream": True, "stream_options": {"include_usage": True}},
        )
        continuous = client.post(
            "/v1/chat/completions",
            json={**body, "stream": True, "stream_options": {"continuous_usage_stats": True}},
        )
    events = [
        json.loads(line.removeprefix("data: "))
        for line in stream.text.splitlines()
        if line.startswith("data: {")
    ]
    streamed = next(e["usage"] for e in events if e.get("usage"))
    cached = [u.pop("prompt_tokens_details")["cached_tokens"] for u in (plain["usage"], streamed)]
    assert plain["usage"] == streamed  # same answer (greedy), same counters, same fields
    # The streamed request resends the first one's prompt: with I-DLM its full pages come
    # from the prefix cache (all but the last token may); canvas denoising has no cache.
    prompt = plain["usage"]["prompt_tokens"]
    assert cached == ([0, (prompt - 1) // 16 * 16] if speculative else [0, 0])
    fields = set(plain["usage"]["diffusion"])
    assert fields & ISD_FIELDS == (ISD_FIELDS if speculative else set())
    assert None not in plain["usage"]["diffusion"].values()
    assert plain["system_fingerprint"] is None  # still present, as OpenAI sends it
    # Every chunk's usage has the same fields, the role chunk's too (found by QA: it lacked
    # the draft counters of a self-speculative request).
    chunks = [
        json.loads(line.removeprefix("data: "))
        for line in continuous.text.splitlines()
        if line.startswith("data: {")
    ]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert {frozenset(c["usage"]["diffusion"]) for c in chunks} == {frozenset(fields)}


def test_a_stop_string_counts_tokens_through_it_not_after_it() -> None:
    loaded = load_model("demo-llada", device="cpu", dtype="float32")
    engine = AsyncEngine(loaded)
    body = {"messages": [{"role": "user", "content": "What is 123 + 456?"}], "max_tokens": 32}
    with TestClient(build_app(engine, ServerConfig())) as client:
        free = client.post("/v1/chat/completions", json=body).json()
        cut = client.post("/v1/chat/completions", json={**body, "stop": ["="]}).json()
        metrics = client.get("/metrics").text
    answer = free["choices"][0]["message"]["content"]
    assert answer == "123 + 456 = 579"
    assert cut["choices"][0]["message"]["content"] == "123 + 456 "
    assert cut["choices"][0]["finish_reason"] == "stop"
    # The greedy answer's tokens: the stopped request made the same ones; it counts those up to
    # the one that completed "=", not the ones committed after it in the same step.
    ids = loaded.tokenizer.encode(answer, add_special_tokens=False)
    through = next(n for n in range(len(ids) + 1) if "=" in loaded.decode(ids[:n]))
    assert cut["usage"]["completion_tokens"] == through < free["usage"]["completion_tokens"]
    generated = [line for line in metrics.splitlines() if line.startswith("dllm:generation_tokens")]
    total = free["usage"]["completion_tokens"] + through
    assert any(line.endswith(f" {float(total)}") for line in generated), generated
