"""Tools through a real uvicorn on 127.0.0.1 and the openai SDK: a model whose chat template
renders tools (tiny Dream, Qwen2.5's template) takes them and a tool round trip's history;
what it cannot do is a 400 the SDK raises."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from remote_server import RemoteServer

from dllm_serve.llm import LLM
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


def test_tools_and_a_round_trip_through_the_sdk(tmp_path: Path) -> None:
    model = write_tiny_dream(tmp_path / "dream")
    server = RemoteServer.start(["--model", str(model), "--log-level", "warning"], tmp_path / "l")
    try:
        client = server.client()
        question = [{"role": "user", "content": "What is 2 + 2?"}]
        reply = client.chat.completions.create(
            model="m", messages=question, tools=[GET_SUM], max_tokens=8
        )
        with LLM(str(model), device="cpu", dtype="float32") as llm:
            (want,) = llm.chat([question], tools=[GET_SUM], max_tokens=8)
        assert reply.choices[0].message.content == want.text  # no call from a random model
        history = [
            *question,
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_sum", "arguments": '{"a": 2, "b": 2}'},
            }]},
            {"role": "tool", "tool_call_id": "call_1", "content": "4"},
        ]  # fmt: skip
        after = client.chat.completions.create(
            model="m", messages=history, tools=[GET_SUM], max_tokens=8
        )
        assert after.choices[0].finish_reason in ("stop", "length", "tool_calls")
        assert after.usage is not None and after.usage.prompt_tokens > reply.usage.prompt_tokens
        with pytest.raises(openai.BadRequestError) as bad:  # both constrain the answer
            client.chat.completions.create(
                model="m", messages=question, tools=[GET_SUM], tool_choice="required",
                response_format={"type": "json_object"},
            )  # fmt: skip
        assert bad.value.body["param"] == "response_format"
    finally:
        server.stop()


def test_a_named_tool_call_on_the_demo_through_the_sdk(tmp_path: Path) -> None:
    """demo-llada was not trained on tools, but a named (or required) call is decoded
    under the function's schema: the SDK gets a call whose arguments validate, and the tool
    round trip goes on."""
    jsonschema = pytest.importorskip("jsonschema")
    small = {"type": "integer", "minimum": 0, "maximum": 999}
    get_sum = {"type": "function", "function": {"name": "get_sum", "parameters": {
        "type": "object", "properties": {"a": small, "b": small}, "required": ["a", "b"],
        "additionalProperties": False}}}  # fmt: skip
    server = RemoteServer.start(["--model", "demo-llada", "--log-level", "warning"],
                                tmp_path / "log")  # fmt: skip
    try:
        client = server.client()
        question = [{"role": "user", "content": "What is 2 + 2?"}]
        reply = client.chat.completions.create(
            model="demo-llada", messages=question, tools=[get_sum], max_tokens=32,
            tool_choice={"type": "function", "function": {"name": "get_sum"}},
        )  # fmt: skip
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_sum" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, get_sum["function"]["parameters"])
        history = [*question, choice.message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "4"}]  # fmt: skip
        after = client.chat.completions.create(model="demo-llada", messages=history, max_tokens=16)
        assert after.choices[0].finish_reason in ("stop", "length")
    finally:
        server.stop()
