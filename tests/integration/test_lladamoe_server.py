"""A LLaDA-MoE-format checkpoint served by a real dllm-serve on 127.0.0.1.

The in-process engine's answers equal LLaDA's reference loops token for token
(tests/unit/decoding/test_decoding_lladamoe.py); here the server, through the openai SDK,
gives the engine's answers, streamed and not, one at a time and all at once, with the server's
defaults, and with explicit blocks and the threshold rule of the published LLaDA-MoE settings.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from remote_server import RemoteServer

from dllm_serve.decoding.params import DecodingParams
from dllm_serve.llm import LLM
from dllm_serve_train.tiny_checkpoints import write_tiny_lladamoe

QUESTIONS = ["What is 2 + 2?", "Reverse the word cat."]
MAX_TOKENS = 12
# (request fields, the DecodingParams the server derives from them)
SETTINGS = [
    ({}, DecodingParams(gen_length=MAX_TOKENS, steps=MAX_TOKENS)),  # the server's defaults
    (
        {"block_length": 4, "confidence_threshold": 0.0021},
        DecodingParams(
            gen_length=MAX_TOKENS, block_length=4, steps=MAX_TOKENS, confidence_threshold=0.0021
        ),
    ),
]


@pytest.fixture(scope="module")
def lladamoe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_lladamoe(Path(tmp_path_factory.mktemp("lladamoe")) / "tiny-lladamoe", seed=3)


def test_server_answers_are_the_engines(lladamoe_dir: Path, tmp_path: Path) -> None:
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    with LLM(str(lladamoe_dir), device="cpu", dtype="float32") as llm:
        want = [llm.generate(chats, params) for _, params in SETTINGS]
    server = RemoteServer.start(
        ["--model", str(lladamoe_dir), "--dtype", "float32", "--log-level", "warning"],
        tmp_path / "log",
    )
    try:
        client = server.client()
        for (extra, _), completions in zip(SETTINGS, want, strict=True):
            for messages, engine in zip(chats, completions, strict=True):
                reply = client.chat.completions.create(
                    model="m", messages=messages, max_tokens=MAX_TOKENS, extra_body=extra
                )
                assert reply.choices[0].message.content == engine.text
                assert reply.usage is not None
                assert reply.usage.completion_tokens == engine.completion_tokens
                chunks = client.chat.completions.create(
                    model="m", messages=messages, max_tokens=MAX_TOKENS, stream=True,
                    extra_body=extra,
                )  # fmt: skip
                streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                assert streamed == engine.text

        # All at once: the server batches mixed requests, and each gets its answer alone.
        def ask(job: tuple[dict, list[dict[str, str]]]) -> str | None:
            extra, messages = job
            reply = client.chat.completions.create(
                model="m", messages=messages, max_tokens=MAX_TOKENS, extra_body=extra
            )
            return reply.choices[0].message.content

        jobs = [(extra, messages) for extra, _ in SETTINGS for messages in chats] * 2
        with ThreadPoolExecutor(len(jobs)) as pool:
            answers = list(pool.map(ask, jobs))
        assert answers == [c.text for completions in want for c in completions] * 2
    finally:
        server.stop()
