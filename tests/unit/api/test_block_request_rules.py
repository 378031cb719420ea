"""Canvas fields by how a request decodes (found by QA): block-diffusion requests are checked
against the trained block, not LLaDA's canvas rules, their steps are per block (one token per
step by default, whatever max_tokens is), and on models without a canvas a canvas field is
refused as not applicable before any canvas arithmetic."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dllm_serve.api.errors import APIError
from dllm_serve.api.pipeline import parse_chat_request, parse_completion_request
from dllm_serve.api.rules import ModelDecoding
from dllm_serve.llm import LLM
from dllm_serve_train.tiny_checkpoints import write_tiny_llada2

JSON = "application/json"
SDAR = ModelDecoding("block_diffusion", block_size=4)
LLADA2 = ModelDecoding("block_diffusion", block_size=32)
TRIMODE = ModelDecoding("tri_mode", block_size=16, default_mode="linear_spec")
IDLM = ModelDecoding("self_speculation")


def chat(model: ModelDecoding, **fields: Any):  # type: ignore[no-untyped-def]
    raw = json.dumps({"messages": [{"role": "user", "content": "hi"}], **fields}).encode()
    return parse_chat_request(raw, JSON, 128, model.block_size, model=model)


@pytest.mark.parametrize(
    ("model", "fields", "steps"),
    [
        (SDAR, {"max_tokens": 5, "block_length": 4}, 4),  # the trained block: no divisor rule
        (LLADA2, {"max_tokens": 6, "block_length": 32}, 32),
        (LLADA2, {"max_tokens": 6}, 32),  # one token per step, not min(128, max_tokens)
        (LLADA2, {"max_tokens": 64}, 32),
        (TRIMODE, {"max_tokens": 40, "block_length": 16, "decoding_mode": "diffusion"}, 16),
        (TRIMODE, {"max_tokens": 40, "num_denoising_steps": 3, "decoding_mode": "diffusion"}, 3),
        (SDAR, {"max_tokens": 1024, "num_denoising_steps": 2}, 2),  # per block: 256 blocks
    ],
)
def test_block_requests_decode_in_the_trained_block(
    model: ModelDecoding, fields: dict[str, Any], steps: int
) -> None:
    params = chat(model, **fields).params
    assert params.gen_length == fields["max_tokens"] and params.answer_limit is None
    assert params.steps == steps  # per block (the block decoders' unit)


def test_completions_follow_the_same_rules() -> None:
    raw = json.dumps({"prompt": "hi", "max_tokens": 5, "block_length": 4}).encode()
    assert parse_completion_request(raw, JSON, 128, 4, model=SDAR).params.steps == 4


@pytest.mark.parametrize(
    ("model", "fields", "param"),
    [
        (LLADA2, {"max_tokens": 32, "block_length": 16}, "block_length"),
        (
            TRIMODE,
            {"max_tokens": 32, "block_length": 8, "decoding_mode": "diffusion"},
            "block_length",
        ),
        (IDLM, {"max_tokens": 40, "num_denoising_steps": 3}, "num_denoising_steps"),
        (IDLM, {"max_tokens": 1024, "block_length": 1}, "block_length"),
        (TRIMODE, {"max_tokens": 40, "num_denoising_steps": 3}, "num_denoising_steps"),  # ar-like
        (
            TRIMODE,
            {"max_tokens": 40, "num_denoising_steps": 3, "decoding_mode": "ar"},
            "num_denoising_steps",
        ),
    ],
)
def test_fields_that_do_not_apply_are_refused_as_such(
    model: ModelDecoding, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(APIError) as info:
        chat(model, **fields)
    assert (info.value.param, info.value.code) == (param, "not_applicable")


def test_canvas_models_keep_the_canvas_rules() -> None:
    llada = ModelDecoding("diffusion")
    with pytest.raises(APIError) as info:
        chat(llada, max_tokens=5, block_length=4)
    assert info.value.param == "block_length" and "must divide" in info.value.message


def test_a_shorter_max_tokens_answers_a_prefix_of_a_longer_one(tmp_path: Path) -> None:
    # With the server's defaults on a block model (one token per step in the trained block),
    # max_tokens only says where the answer is cut (it used to change the steps per block).
    path = write_tiny_llada2(tmp_path / "tiny-llada2", seed=3)
    chat_ = [{"role": "user", "content": "What is 2 + 2?"}]
    with LLM(str(path), device="cpu", dtype="float32") as llm:
        model = ModelDecoding("block_diffusion", block_size=llm.loaded.block_size)
        answers = {}
        for max_tokens in (3, 6, 11, 40):
            params = chat(model, max_tokens=max_tokens, ignore_eos=True).params
            answers[max_tokens] = llm.generate([chat_], params)[0].text
        # The offline API's defaults are the server's: the model's canvas, one token per step.
        default = llm.loaded.default_gen_length or 128
        params = chat(model, max_tokens=default).params
        assert llm.generate([chat_])[0].text == llm.generate([chat_], params)[0].text
    assert all(answers[40].startswith(answers[n]) for n in (3, 6, 11)), answers
    assert len(set(answers.values())) == 4  # the texts do grow
