"""The trained demo models through a real server and the openai SDK: `dllm-serve` with no
arguments serves demo-llada, `--model demo-idlm` the I-DLM demo, and both answer."""

from __future__ import annotations

from pathlib import Path

from remote_server import RemoteServer

from dllm_serve.models.families.llada import LLADA
from dllm_serve.models.hub import EMBEDDED_MODELS
from dllm_serve.models.tokenization import load_tokenizer

QUESTION = [{"role": "user", "content": "What is 123 + 456?"}]


def _ask_twice(server: RemoteServer) -> tuple[object, str]:
    client = server.client()
    reply = client.chat.completions.create(model="any", messages=QUESTION)
    chunks = client.chat.completions.create(model="any", messages=QUESTION, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return reply, streamed


def test_no_arguments_serves_the_trained_llada_demo(tmp_path: Path) -> None:
    server = RemoteServer.start(["--log-level", "warning"], tmp_path / "log", pin_model=False)
    try:
        assert [m.id for m in server.client().models.list().data] == ["demo-llada"]
        reply, streamed = _ask_twice(server)
        assert reply.model == "demo-llada"
        answer = reply.choices[0].message.content
        assert answer == "123 + 456 = 579"
        assert reply.choices[0].finish_reason == "stop"
        assert streamed == answer
        diffusion = reply.usage.model_extra["diffusion"]
        assert diffusion["canvas_length"] == 32  # the model's max_new_tokens, no max_tokens sent
        # Answer tokens only: no end-of-turn token, no EOS padding.
        tokenizer = load_tokenizer(Path(EMBEDDED_MODELS["demo-llada"]), LLADA)
        assert reply.usage.completion_tokens == len(
            tokenizer.encode(answer, add_special_tokens=False)
        )
        assert diffusion["nfe"] <= 32
    finally:
        server.stop()


def test_demo_idlm_answers_with_accepted_drafts(tmp_path: Path) -> None:
    server = RemoteServer.start(
        ["--model", "demo-idlm", "--log-level", "warning"], tmp_path / "log"
    )
    try:
        reply, streamed = _ask_twice(server)
        assert reply.model == "demo-idlm"
        assert reply.choices[0].message.content == streamed == "123 + 456 = 579"
        diffusion = reply.usage.model_extra["diffusion"]
        # Self-speculation: drafts verified and mostly accepted, > 1 token per forward.
        assert diffusion["drafted_tokens"] > 0
        assert diffusion["accepted_drafts"] / diffusion["drafted_tokens"] > 0.5
        assert diffusion["nfe"] < reply.usage.completion_tokens
    finally:
        server.stop()
