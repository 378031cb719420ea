"""A LLaDA2.2-style checkpoint (insert/delete edit tokens, block routing) served by a real
dllm-serve on 127.0.0.1, through the openai SDK.

The in-process engine equals the no-cache JointThresholdInDel loop
(tests/unit/decoding/test_decoding_indel.py); here the server gives the engine's answers,
streamed and not, by the checkpoint's preset (s_mode) and with a request's own thresholds,
and refuses what the rule cannot do (sampling, logprobs) with a 400 naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from remote_server import RemoteServer
from safetensors.torch import load_file, save_file

from dllm_serve.decoding.params import DecodingParams
from dllm_serve.llm import LLM
from dllm_serve_train.tiny_checkpoints import write_tiny_llada2

QUESTIONS = ["What is 2 + 2?", "Reverse the word cat."]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def llada22_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_tiny_llada2(
        Path(tmp_path_factory.mktemp("llada22")) / "tiny-llada22", block_size=4, seed=3,
        levenshtein=True,
    )  # fmt: skip
    # DELETE and SPLIT's head rows scaled up: the random model then writes them.
    config = json.loads((path / "config.json").read_text())
    weights = load_file(str(path / "model.safetensors"))
    for token in (config["delete_token_id"], config["split_token_id"]):
        weights["lm_head.weight"][token] *= 3.0
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


RULES = [{}, {"edit_threshold": 0.0, "confidence_threshold": 0.002, "max_post_edit_steps": 2}]


def test_server_answers_are_the_engines(llada22_dir: Path, tmp_path: Path) -> None:
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    preset = {"confidence_threshold": 0.5, "edit_threshold": 0.0}  # generation_config s_mode
    with LLM(str(llada22_dir), device="cpu", dtype="float32") as llm:
        assert llm.engine.insert_delete and llm.engine.decoding_algorithm == "s_mode"
        want = [
            [llm.generate([chat], DecodingParams(gen_length=MAX_TOKENS, steps=MAX_TOKENS,
                                                 **(rule or preset)))[0].text
             for chat in chats]
            for rule in RULES
        ]  # fmt: skip
    server = RemoteServer.start(
        ["--model", str(llada22_dir), "--log-level", "warning"], tmp_path / "log"
    )
    try:
        client = server.client()
        for rule, texts in zip(RULES, want, strict=True):
            for messages, text in zip(chats, texts, strict=True):
                reply = client.chat.completions.create(
                    model="m", messages=messages, max_tokens=MAX_TOKENS, extra_body=rule
                )
                assert reply.choices[0].message.content == text, rule
                chunks = client.chat.completions.create(
                    model="m", messages=messages, max_tokens=MAX_TOKENS, stream=True,
                    extra_body=rule,
                )  # fmt: skip
                streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                assert streamed == text, rule
        for kwargs, param in (
            ({"temperature": 0.7}, "temperature"),
            ({"logprobs": True}, "logprobs"),
        ):
            with pytest.raises(openai.BadRequestError) as bad:
                client.chat.completions.create(model="m", messages=chats[0], max_tokens=8, **kwargs)
            assert bad.value.body["param"] == param  # type: ignore[index]
            assert "JointThresholdInDel" in bad.value.body["message"]  # type: ignore[index]
        # Another commit rule samples as on any LLaDA2 checkpoint.
        sampled = client.chat.completions.create(
            model="m", messages=chats[0], max_tokens=8, temperature=0.7, seed=1,
            extra_body={"confidence_threshold": 0.9},
        )  # fmt: skip
        assert sampled.choices[0].finish_reason in ("stop", "length")
    finally:
        server.stop()
