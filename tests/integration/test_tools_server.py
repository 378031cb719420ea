"""Tools through a real uvicorn on 127.0.0.1 and the openai SDK: a model whose chat template
renders tools (tiny Dream, Qwen2.5's template) takes them and a tool round trip's history;
what it cannot do is a 400 the SDK raises."""

from __future__ import annotations

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
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(
                model="m", messages=question, tools=[GET_SUM], tool_choice="required"
            )
        assert bad.value.body["param"] == "tool_choice"
        assert bad.value.body["code"] == "not_available_yet"
    finally:
        server.stop()
