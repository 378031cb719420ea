"""A Fast-dLLM v2 checkpoint served by a real dllm-serve on 127.0.0.1, asked with the openai SDK.

The server's answers equal the plain no-cache re-statement of the official ``generate`` loop
(``tests/unit/decoding/fastdllm_reference.py``) token for token and forward for forward, streamed
and not: at the server's defaults (one token per forward, the official loop at its default
threshold 1) and with the serving threshold (``confidence_threshold``). Another block than
the trained 32 is a 400.
"""

from __future__ import annotations

import sys
from pathlib import Path

import openai
import pytest
from remote_server import RemoteServer

from dllm_serve.models.loader import load_model
from dllm_serve_train.tiny_checkpoints import write_tiny_fastdllm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "decoding"))
from fastdllm_reference import reference  # the unit tests' reference loop

QUESTIONS = ["What is 2 + 2?", "Reverse the word cat, then spell it out letter by letter."]
MAX_TOKENS = 40  # crosses a block boundary
THRESHOLD = 0.0014  # commits several tokens in some steps of the tiny random model


@pytest.fixture(scope="module")
def fastdllm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_fastdllm(Path(tmp_path_factory.mktemp("fd")) / "tiny-fastdllm", seed=4)


def test_server_answers_are_the_official_loops(fastdllm_dir: Path, tmp_path: Path) -> None:
    loaded = load_model(str(fastdllm_dir), device="cpu", dtype="float32")
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    prompts = [loaded.chat_prompt_ids(messages) for messages in chats]
    assert {len(p) // 32 for p in prompts} == {1}  # a prefill and a first block past the prompt
    settings = {"defaults": ({}, {"threshold": 1.0}), "threshold": (
        {"confidence_threshold": THRESHOLD}, {"threshold": THRESHOLD})}  # fmt: skip
    server = RemoteServer.start(
        ["--model", str(fastdllm_dir), "--log-level", "warning"], tmp_path / "log"
    )
    try:
        client = server.client()  # max_retries=0
        commits = []
        for extra, rule in settings.values():
            for messages, prompt in zip(chats, prompts, strict=True):
                want, steps = reference(loaded, prompt, MAX_TOKENS, **rule)
                commits += steps
                text = loaded.decode(want)
                reply = client.chat.completions.create(
                    model="m", messages=messages, max_tokens=MAX_TOKENS, extra_body=extra
                )
                assert reply.choices[0].message.content == text
                assert reply.usage is not None and reply.usage.completion_tokens == len(want)
                # A repeated prompt's whole blocks come from the prefix cache: its prefill
                # forward is skipped, the answer is the same.
                details = reply.usage.prompt_tokens_details
                assert details is not None and details.cached_tokens in (0, len(prompt) // 32 * 32)
                skipped = 1 if details.cached_tokens else 0
                assert reply.usage.model_extra["diffusion"]["nfe"] == len(steps) - skipped
                chunks = client.chat.completions.create(
                    model="m", messages=messages, max_tokens=MAX_TOKENS, stream=True,
                    extra_body=extra,
                )  # fmt: skip
                streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                assert streamed == text
        assert max(commits) > 1  # the threshold rule committed several tokens at once
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(
                model="m", messages=chats[0], max_tokens=32, extra_body={"block_length": 16}
            )
        assert "must be 32" in str(bad.value)
    finally:
        server.stop()
