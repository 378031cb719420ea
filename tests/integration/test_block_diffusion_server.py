"""A block-diffusion (SDAR-format) checkpoint served by a real dllm-serve on 127.0.0.1.

The in-process engine's answers equal the no-cache official loop token for token
(tests/unit/decoding/test_decoding_block_diffusion.py); here the server, through the openai
SDK, gives the engine's answers, streamed and not.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from remote_server import RemoteServer

from dllm_serve.decoding.params import DecodingParams
from dllm_serve.llm import LLM
from dllm_serve_train.tiny_checkpoints import write_tiny_sdar

QUESTIONS = ["What is 2 + 2?", "Reverse the word cat."]


@pytest.fixture(scope="module")
def sdar_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_sdar(
        Path(tmp_path_factory.mktemp("sdar")) / "tiny-sdar", block_size=4, seed=3
    )


def test_server_answers_are_the_engines(sdar_dir: Path, tmp_path: Path) -> None:
    params = DecodingParams(gen_length=11, steps=11)  # the server's defaults for max_tokens 11
    with LLM(str(sdar_dir), device="cpu", dtype="float32") as llm:
        want = [c.text for c in llm.generate([[{"role": "user", "content": q}] for q in QUESTIONS],
                                             params)]  # fmt: skip
    server = RemoteServer.start(
        ["--model", str(sdar_dir), "--log-level", "warning"], tmp_path / "log"
    )
    try:
        client = server.client()
        for question, text in zip(QUESTIONS, want, strict=True):
            messages = [{"role": "user", "content": question}]
            reply = client.chat.completions.create(model="m", messages=messages, max_tokens=11)
            assert reply.choices[0].message.content == text
            assert reply.usage is not None and reply.usage.completion_tokens <= 11
            chunks = client.chat.completions.create(
                model="m", messages=messages, max_tokens=11, stream=True
            )
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    finally:
        server.stop()
