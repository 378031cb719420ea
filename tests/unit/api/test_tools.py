"""Tool calls: tools rendered by the model's chat template, a tool round trip's messages,
the hermes parser, the response and stream shapes, and the 400s."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from dllm_serve.api.app import build_app
from dllm_serve.api.pipeline import ModelFacts, chat_request
from dllm_serve.api.streaming import chat_chunks, merged
from dllm_serve.api.tools import ToolSpec, parse_calls
from dllm_serve.config import ServerConfig
from dllm_serve.engine.engine import AsyncEngine
from dllm_serve.engine.outputs import RequestOutput
from dllm_serve.models.loader import load_model
from dllm_serve_train.tiny_checkpoints import write_tiny_dream

GET_SUM = {
    "type": "function",
    "function": {
        "name": "get_sum",
        "description": "Add two numbers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]
HERMES = ToolSpec([GET_SUM], "auto", parser="hermes")


def test_hermes_calls_are_parsed_and_the_rest_is_content() -> None:
    text = (
        'Let me add.\n<tool_call>\n{"name": "get_sum", "arguments": {"a": 2, "b": 2}}\n'
        '</tool_call>\n<tool_call>{"name": "get_sum", "arguments": {"a": 1, "b": 5}}</tool_call>'
    )
    content, calls = parse_calls(text, HERMES)
    assert content == "Let me add."
    assert [c["function"]["name"] for c in calls] == ["get_sum", "get_sum"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"a": 2, "b": 2}, {"a": 1, "b": 5},
    ]  # fmt: skip
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 2
    one = ToolSpec([GET_SUM], "auto", parallel=False, parser="hermes")
    assert len(parse_calls(text, one)[1]) == 1
    # Only calls: no content; a malformed block stays text; tool_choice none parses nothing.
    assert (
        parse_calls('<tool_call>{"name": "get_sum", "arguments": {}}</tool_call>', HERMES)[0]
        is None
    )
    broken = "<tool_call>{not json}</tool_call>"
    assert parse_calls(broken, HERMES) == (broken, [])
    assert parse_calls(text, ToolSpec([GET_SUM], "none", parser="hermes")) == (text, [])


def _output(text: str, finished: bool = False) -> RequestOutput:
    return RequestOutput(
        request_id="r", delta_text=text, prompt_tokens=3, completion_tokens=4, nfe=1,
        committed=4, step=1, block=0, finished=finished,
        finish_reason="stop" if finished else None,
    )  # fmt: skip


def test_a_streamed_call_comes_as_one_tool_calls_delta() -> None:
    async def outputs() -> AsyncGenerator[RequestOutput, None]:
        yield _output('<tool_call>{"name": "get_sum", ')
        yield _output('"arguments": {"a": 2, "b": 2}}</tool_call>', finished=True)

    async def collect() -> list[dict]:
        chunks = chat_chunks(
            merged([outputs()]), response_id="x", created=0, model="m", canvas_length=8,
            include_usage=False, tools=HERMES,
        )  # fmt: skip
        return [json.loads(c) for c in [c async for c in chunks] if c != "[DONE]"]

    chunks = asyncio.run(collect())
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert len(calls) == 1 and calls[0][0]["index"] == 0
    assert json.loads(calls[0][0]["function"]["arguments"]) == {"a": 2, "b": 2}
    assert not any(d.get("content") for d in deltas[1:])  # the call is not also text
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.fixture(scope="module")
def dream_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_dream(Path(tmp_path_factory.mktemp("dream")) / "m")


@pytest.fixture
def dream(dream_path: Path) -> AsyncEngine:
    """A fresh engine (a test client starts it and stops it when it closes)."""
    return AsyncEngine(load_model(str(dream_path), device="cpu", dtype="float32"))


def test_tools_and_a_round_trip_are_rendered_by_the_template(dream: AsyncEngine) -> None:
    facts = ModelFacts(dream)
    history = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_sum", "arguments": '{"a": 2, "b": 2}'},
        }]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4"},
    ]  # fmt: skip
    body = {"messages": history, "tools": [GET_SUM], "max_tokens": 8}
    with TestClient(build_app(dream, ServerConfig())):  # the engine runs
        spec, ids = chat_request(facts, json.dumps(body).encode(), "application/json")
        plain, plain_ids = chat_request(
            facts, json.dumps({"messages": QUESTION}).encode(), "application/json"
        )
    assert spec.tools is not None and spec.tools.parser == "hermes" and spec.tools.parse
    prompt = dream.loaded.tokenizer.decode(ids)
    assert '"name": "get_sum"' in prompt and "<tools>" in prompt  # the tool's schema
    assert '<tool_call>\n{"name": "get_sum", "arguments": {"a": 2, "b": 2}}' in prompt
    assert "<tool_response>\n4\n</tool_response>" in prompt
    assert plain.tools is None and len(plain_ids) < len(ids)


def test_a_chat_with_tools_answers_through_the_server(dream: AsyncEngine) -> None:
    with TestClient(build_app(dream, ServerConfig())) as client:
        body = {"messages": QUESTION, "tools": [GET_SUM], "max_tokens": 8}
        reply = client.post("/v1/chat/completions", json=body)
        stream = client.post("/v1/chat/completions", json={**body, "stream": True})
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    # A random model writes no call: its text is the content, as without tools.
    assert choice["finish_reason"] in ("stop", "length") and "tool_calls" not in choice["message"]
    streamed = "".join(
        chunk["choices"][0]["delta"].get("content") or ""
        for chunk in (json.loads(line[5:]) for line in stream.text.splitlines()
                      if line.startswith("data:") and line != "data: [DONE]")
        if chunk["choices"]
    )  # fmt: skip
    assert streamed == choice["message"]["content"]


@pytest.mark.parametrize(
    ("model", "extra", "param", "code"),
    [
        ("tiny-llada", {}, "tools", "not_applicable"),  # its template renders no tools
        ("dream", {"tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format", None),
        ("dream", {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice", None),
        ("dream", {"tools": [{"type": "function", "function": {"name": "a b"}}]},
         "tools[0].function.name", None),
        ("dream", {"tools": [GET_SUM, GET_SUM]}, "tools", None),
        ("dream", {"messages": [*QUESTION, {"role": "tool", "content": "4"}]},
         "messages[1].tool_call_id", None),
        ("dream", {"functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
    ],
)  # fmt: skip
def test_tool_requests_this_server_cannot_honour_are_400s(
    dream: AsyncEngine, model: str, extra: dict, param: str, code: str | None
) -> None:
    engine = dream if model == "dream" else AsyncEngine(load_model(model, device="cpu"))
    body = {"messages": QUESTION, "tools": [GET_SUM], **extra}
    with TestClient(build_app(engine, ServerConfig())) as client:
        reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert (error["param"], error["code"]) == (param, code)


@pytest.mark.parametrize("choice", ["named", "required"])
def test_a_forced_call_is_decoded_under_its_schema(dream_path: Path, choice: str) -> None:
    """tool_choice required / a named function: the grammar makes the answer one call whose
    arguments validate against the function's parameters, even from a random model."""
    jsonschema = pytest.importorskip("jsonschema")
    # Bounded numbers and strings: a random model would extend an unbounded one to max_tokens.
    small = {"type": "integer", "minimum": 0, "maximum": 99}
    get_sum = {"type": "function", "function": {"name": "get_sum", "parameters": {
        "type": "object", "properties": {"a": small, "b": small}, "required": ["a", "b"],
        "additionalProperties": False}}}  # fmt: skip
    other = {"type": "function", "function": {"name": "echo", "parameters": {
        "type": "object", "properties": {"text": {"type": "string", "maxLength": 5}},
        "required": ["text"], "additionalProperties": False}}}  # fmt: skip
    tool_choice = {"type": "function", "function": {"name": "get_sum"}} if choice == "named" else (
        "required"
    )  # fmt: skip
    body = {"messages": QUESTION, "tools": [get_sum, other], "tool_choice": tool_choice,
            "max_tokens": 48}  # fmt: skip
    engine = AsyncEngine(load_model(str(dream_path), device="cpu", dtype="float32"))
    with TestClient(build_app(engine, ServerConfig())) as client:
        reply = client.post("/v1/chat/completions", json=body)
        streamed = client.post("/v1/chat/completions", json={**body, "stream": True}).text
    assert reply.status_code == 200, reply.text
    choice_body = reply.json()["choices"][0]
    assert choice_body["finish_reason"] == "tool_calls", choice_body
    (call,) = choice_body["message"]["tool_calls"]
    assert choice_body["message"]["content"] is None
    schemas = {"get_sum": get_sum, "echo": other}
    name = call["function"]["name"]
    assert name == "get_sum" if choice == "named" else name in schemas
    params = schemas[name]["function"]["parameters"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), params)
    deltas = [
        c["choices"][0]["delta"]
        for c in (json.loads(line[5:]) for line in streamed.splitlines()
                  if line.startswith("data:") and line != "data: [DONE]")
        if c["choices"]
    ]  # fmt: skip
    (streamed_calls,) = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert streamed_calls[0]["function"]["arguments"] == call["function"]["arguments"]


BOUNDED_SUM = {"type": "function", "function": {"name": "get_sum", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["a", "b"],
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                   "b": {"type": "integer", "minimum": 0, "maximum": 99}}}}}  # fmt: skip


@pytest.fixture(scope="module")
def eager_caller(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Dream whose LM head favours ``<tool_call>`` (its row scaled up), so
    answers open calls often: unconstrained, what follows the marker is random text."""
    from safetensors.torch import load_file, save_file

    path = write_tiny_dream(Path(tmp_path_factory.mktemp("caller")) / "m", seed=4)
    tokenizer = load_model(str(path), device="cpu", dtype="float32").tokenizer
    weights = load_file(str(path / "model.safetensors"))
    marker = tokenizer.convert_tokens_to_ids("<tool_call>")
    weights["lm_head.weight"][marker] *= 15.0
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    return path


def test_auto_answers_are_text_or_valid_calls(eager_caller: Path) -> None:
    """tool_choice auto on a hermes template is decoded under "text, or text then valid
    calls": over seeds, every answer is either text without a call marker or calls whose
    arguments validate (finish_reason tool_calls), and the calls do occur. tool_choice none
    is free text (no grammar)."""
    jsonschema = pytest.importorskip("jsonschema")
    engine = AsyncEngine(load_model(str(eager_caller), device="cpu", dtype="float32"))
    facts = ModelFacts(engine)
    calls_seen = 0
    with TestClient(build_app(engine, ServerConfig())) as client:
        body = {"messages": QUESTION, "tools": [BOUNDED_SUM], "max_tokens": 128}
        spec, _ = chat_request(facts, json.dumps(body).encode(), "application/json")
        none = {**body, "tool_choice": "none"}
        free, _ = chat_request(facts, json.dumps(none).encode(), "application/json")
        assert spec.params.grammar is not None and free.params.grammar is None
        for seed in range(6):
            reply = client.post(
                "/v1/chat/completions", json={**body, "temperature": 1.0, "seed": seed}
            )
            assert reply.status_code == 200, reply.text
            choice = reply.json()["choices"][0]
            message = choice["message"]
            assert "<tool_call>" not in (message["content"] or ""), message
            for call in message.get("tool_calls") or []:
                jsonschema.validate(
                    json.loads(call["function"]["arguments"]),
                    BOUNDED_SUM["function"]["parameters"],
                )
                calls_seen += 1
            if message.get("tool_calls"):
                assert choice["finish_reason"] == "tool_calls"
    assert calls_seen > 0
