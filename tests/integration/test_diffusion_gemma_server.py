"""A DiffusionGemma-format checkpoint served by a real dllm-serve on 127.0.0.1, through the
openai SDK: the engine's answers (the sampler equals transformers' ``generate``,
tests/unit/decoding/test_decoding_renoise.py), same seed ⇒ same answer, concurrent ==
alone, streamed == not, answers over several canvases, structured output and a forced tool
call, and the 400s of the fields that do not apply to a uniform-state model."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
from remote_server import RemoteServer

from dllm_serve.decoding.params import DecodingParams
from dllm_serve.llm import LLM
from dllm_serve_train.tiny_checkpoints import write_tiny_diffusion_gemma

CANVAS = 32
QUESTIONS = ["What is 2 + 2?", "Tell me a story.", "Reverse the word cat."]


@pytest.fixture(scope="module")
def dg_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = Path(tmp_path_factory.mktemp("dg")) / "tiny-dg"
    return write_tiny_diffusion_gemma(out, canvas_length=CANVAS, seed=2)


@pytest.fixture(scope="module")
def server(dg_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    log = tmp_path_factory.mktemp("dg-server") / "log"
    srv = RemoteServer.start(["--model", str(dg_dir), "--log-level", "warning"], log)
    yield srv
    srv.stop()


def chat(client: openai.OpenAI, question: str, **extra: Any) -> Any:
    body = {"num_denoising_steps": 8, **extra}
    max_tokens = body.pop("max_tokens", 2 * CANVAS)
    return client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": question}], max_tokens=max_tokens,
        extra_body=body,
    )  # fmt: skip


def test_answers_are_the_engines_and_seeded(dg_dir: Path, server: Any) -> None:
    client = server.client()
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    with LLM(str(dg_dir), device="cpu", dtype="float32") as llm:
        want = [
            c.text
            for c in llm.generate(chats, DecodingParams(gen_length=2 * CANVAS, steps=8, seed=5))
        ]
    got = [chat(client, q, seed=5) for q in QUESTIONS]
    assert [r.choices[0].message.content for r in got] == want
    again = chat(client, QUESTIONS[0], seed=5).choices[0].message.content
    assert again == want[0]  # same seed, same answer
    other = chat(client, QUESTIONS[0], seed=6).choices[0].message.content
    assert other != want[0]
    # Concurrent requests share forwards and still give what each gives alone.
    with ThreadPoolExecutor(3) as pool:
        together = list(pool.map(lambda q: chat(client, q, seed=5), QUESTIONS))
    assert [r.choices[0].message.content for r in together] == want


def test_stream_equals_json_and_answers_span_canvases(server: Any) -> None:
    client = server.client()
    # ignore_eos: every canvas is emitted, so the answer is max_tokens tokens from 3 canvases.
    reply = chat(client, QUESTIONS[1], seed=9, ignore_eos=True, max_tokens=2 * CANVAS + 8)
    assert reply.usage is not None and reply.usage.completion_tokens == 2 * CANVAS + 8
    assert reply.choices[0].finish_reason == "length"
    chunks = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": QUESTIONS[1]}], max_tokens=2 * CANVAS + 8,
        stream=True, extra_body={"num_denoising_steps": 8, "seed": 9, "ignore_eos": True},
    )  # fmt: skip
    deltas = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    assert "".join(deltas) == reply.choices[0].message.content
    assert len(deltas) >= 2  # streamed a canvas at a time, not all at the end
    # The checkpoint's defaults (48 steps, its entropy bound) and another bound both run.
    default = chat(client, QUESTIONS[0], seed=1, num_denoising_steps=None, max_tokens=CANVAS)
    wide = chat(client, QUESTIONS[0], seed=1, num_denoising_steps=None, max_tokens=CANVAS,
                entropy_bound=40.0)  # fmt: skip
    assert default.choices[0].message.content != wide.choices[0].message.content


def test_structured_output_and_a_forced_tool_call(server: Any) -> None:
    """response_format through the SDK's ``parse`` validates on the random model (answers
    spanning canvases), streamed == not; a named tool call is decoded under its schema."""
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=12)
        age: int = Field(ge=0, le=120)

    client = server.client()
    messages = [{"role": "user", "content": "Describe a person in JSON."}]
    extra = {"num_denoising_steps": 8, "seed": 4}
    reply = client.beta.chat.completions.parse(
        model="m", messages=messages, response_format=Person, max_tokens=3 * CANVAS,
        extra_body=extra,
    )  # fmt: skip
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(reply.choices[0].message.parsed, Person)
    schema = {
        "type": "json_schema",
        "json_schema": {"name": "p", "schema": Person.model_json_schema()},
    }
    chunks = client.chat.completions.create(
        model="m", messages=messages, response_format=schema, max_tokens=3 * CANVAS,
        stream=True, extra_body=extra,
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content
    get_age = {"type": "function", "function": {"name": "get_age", "parameters": {
        "type": "object", "properties": {"years": {"type": "integer", "minimum": 0,
        "maximum": 99}}, "required": ["years"], "additionalProperties": False}}}  # fmt: skip
    called = client.chat.completions.create(
        model="m", messages=messages, tools=[get_age], max_tokens=2 * CANVAS, extra_body=extra,
        tool_choice={"type": "function", "function": {"name": "get_age"}},
    )  # fmt: skip
    (call,) = called.choices[0].message.tool_calls or []
    assert called.choices[0].finish_reason == "tool_calls" and call.function.name == "get_age"
    assert 0 <= json.loads(call.function.arguments)["years"] <= 99


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"block_length": 16}, "block_length", "uniform-state"),
        ({"confidence_threshold": 0.9}, "confidence_threshold", "entropy bound"),
        ({"use_local_leap": True}, "use_local_leap", "no masks"),
        ({"block_schedule": "cosine"}, "block_schedule", "schedule"),
        ({"target_length": 32}, "target_length", "canvas_length"),
        ({"temperature": 0.7}, "temperature", "temperature schedule"),
        ({"num_denoising_steps": 49}, "num_denoising_steps", "max_denoising_steps"),
    ],
)
def test_fields_that_do_not_apply_are_400s(
    server: Any, extra: dict, param: str, words: str
) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        chat(server.client(), QUESTIONS[0], **extra)
    body = bad.value.body
    assert isinstance(body, dict) and body.get("param") == param
    assert words in body["message"]


def test_an_image_part_is_a_400(server: Any) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        server.client().chat.completions.create(
            model="m", max_tokens=8,
            messages=[{"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            ]}],
        )  # fmt: skip
    assert "only text parts" in str(bad.value)


def test_info_lists_the_mode_and_fields(server: Any) -> None:
    info = server.http().get("/v1/dllm/info").json()
    assert info["decoding_mode"] == "renoise" and info["modes"] == ["diffusion"]
    assert info["canvas_length"] == CANVAS and info["max_denoising_steps"] == 48
    assert "entropy_bound" in info["fields"] and "block_length" in info["refused_fields"]


def test_the_trace_route_streams_renoise_events(server: Any) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "seed": 1}
    reply = server.http().post("/v1/dllm/trace", json=body)
    assert reply.status_code == 200
    names = [line[6:].strip() for line in reply.text.splitlines() if line.startswith("event:")]
    assert names[0] == "start" and names[-1] == "done" and "renoise" in names
