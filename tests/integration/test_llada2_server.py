"""A LLaDA2-format (``llada2_moe``) checkpoint served by a real dllm-serve on 127.0.0.1.

The in-process engine's answers equal the no-cache official loop token for token
(tests/unit/decoding/test_decoding_llada2.py); here the server, through the openai SDK, gives
the engine's answers, streamed and not, with the server's defaults and with the official
commit rule (``confidence_threshold``), and refuses another block than the trained 32.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from remote_server import RemoteServer

from dllm_serve.decoding.params import DecodingParams
from dllm_serve.llm import LLM
from dllm_serve_train.tiny_checkpoints import write_tiny_llada2

QUESTIONS = ["What is 2 + 2?", "Reverse the word cat."]
MAX_TOKENS = 11


@pytest.fixture(scope="module")
def llada2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llada2(Path(tmp_path_factory.mktemp("llada2")) / "tiny-llada2", seed=3)


def test_server_answers_are_the_engines(llada2_dir: Path, tmp_path: Path) -> None:
    # The server's defaults for max_tokens 11: the trained block of 32, 32 steps per block
    # (one token per step, however short max_tokens is).
    settings = [
        DecodingParams(gen_length=MAX_TOKENS, steps=32),
        DecodingParams(gen_length=MAX_TOKENS, steps=32, confidence_threshold=0.002),
    ]
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    with LLM(str(llada2_dir), device="cpu", dtype="float32") as llm:
        want = [[c.text for c in llm.generate(chats, params)] for params in settings]
    server = RemoteServer.start(
        ["--model", str(llada2_dir), "--log-level", "warning"], tmp_path / "log"
    )
    try:
        client = server.client()
        for extra, texts in zip([{}, {"confidence_threshold": 0.002}], want, strict=True):
            for messages, text in zip(chats, texts, strict=True):
                reply = client.chat.completions.create(
                    model="m", messages=messages, max_tokens=MAX_TOKENS, extra_body=extra
                )
                assert reply.choices[0].message.content == text
                assert reply.usage is not None and reply.usage.completion_tokens <= MAX_TOKENS
                chunks = client.chat.completions.create(
                    model="m", messages=messages, max_tokens=MAX_TOKENS, stream=True,
                    extra_body=extra,
                )  # fmt: skip
                streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                assert streamed == text
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(
                model="m", messages=chats[0], max_tokens=32, extra_body={"block_length": 16}
            )
        assert "must be 32" in str(bad.value)
        check_editing_and_entropy_rules(client, llada2_dir, chats)
    finally:
        server.stop()


# LLaDA2.1 token editing (S mode's edit threshold) and the entropy rules, per request.
RULES = [
    {"edit_threshold": 0.0, "confidence_threshold": 0.002},
    {"edit_threshold": 0.0, "max_post_edit_steps": 2},
    {"entropy_bound": 7.0},
    {"entropy_threshold": 6.63},
]


def check_editing_and_entropy_rules(
    client: openai.OpenAI, llada2_dir: Path, chats: list[list[dict[str, str]]]
) -> None:
    with LLM(str(llada2_dir), device="cpu", dtype="float32") as llm:
        want = [
            [llm.generate([chat], DecodingParams(gen_length=MAX_TOKENS, steps=32, **rule))[0].text
             for chat in chats]
            for rule in RULES
        ]  # fmt: skip
    for rule, texts in zip(RULES, want, strict=True):
        for messages, text in zip(chats, texts, strict=True):
            reply = client.chat.completions.create(
                model="m", messages=messages, max_tokens=MAX_TOKENS, extra_body=rule
            )
            assert reply.choices[0].message.content == text, rule
            chunks = client.chat.completions.create(
                model="m", messages=messages, max_tokens=MAX_TOKENS, stream=True, extra_body=rule
            )
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    for extra, param in (
        ({"entropy_bound": 0.5, "confidence_metric": "top1_prob"}, "confidence_metric"),
        ({"entropy_bound": 0.5, "edit_threshold": 0.1}, "edit_threshold"),
        ({"max_post_edit_steps": 4}, "max_post_edit_steps"),
    ):
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(
                model="m", messages=chats[0], max_tokens=8, extra_body=extra
            )
        assert bad.value.body["param"] == param  # type: ignore[index]
    info = client.get("/dllm/info", cast_to=object)  # the client's base URL ends in /v1
    assert "joint_threshold" in info["commit_rules"]  # type: ignore[index]
    assert "edit_threshold" in info["diffusion_fields"]  # type: ignore[index]
