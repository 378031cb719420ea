"""The request rules of a DiffusionGemma model (``api/rules.py``, kind ``renoise``): what each
field becomes, and the 400s of the fields that do not apply."""

from __future__ import annotations

import json

import pytest

from dllm_serve.api.errors import APIError
from dllm_serve.api.pipeline import parse_chat_request
from dllm_serve.api.rules import ModelDecoding, renoise_info

MODEL = ModelDecoding("renoise", canvas_length=256, max_denoising_steps=48)
MESSAGES = [{"role": "user", "content": "hi"}]


def parse(**fields: object):
    body = json.dumps({"messages": MESSAGES, **fields}).encode()
    return parse_chat_request(body, "application/json", default_gen_length=256, model=MODEL)


def test_fields_become_the_renoise_params() -> None:
    params = parse().params
    assert (params.gen_length, params.steps, params.seed, params.entropy_bound) == (
        256, 48, None, None,
    )  # fmt: skip
    params = parse(max_tokens=600, num_denoising_steps=16, seed=7, entropy_bound=0.3).params
    assert (params.gen_length, params.steps, params.seed, params.entropy_bound) == (
        600, 16, 7, 0.3,
    )  # fmt: skip
    assert params.block_length == 600  # a formality: the renoise decoder has no blocks


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"block_length": 32}, "block_length"),
        ({"target_length": 64}, "target_length"),
        ({"confidence_threshold": 0.9}, "confidence_threshold"),
        ({"use_local_leap": True}, "use_local_leap"),
        ({"local_leap_radius": 2}, "local_leap_radius"),
        ({"block_schedule": "cosine"}, "block_schedule"),
        ({"confidence_metric": "entropy_inverse"}, "confidence_metric"),
        ({"temperature": 0}, "temperature"),
        ({"top_k": 1}, "top_k"),
        ({"num_denoising_steps": 49}, "num_denoising_steps"),
        ({"entropy_bound": 0}, "entropy_bound"),
        ({"entropy_threshold": 1.0}, "entropy_threshold"),
        ({"edit_threshold": 0.1}, "edit_threshold"),
        ({"max_post_edit_steps": 2}, "max_post_edit_steps"),
        ({"decoding_mode": "ar"}, "decoding_mode"),
    ],
)
def test_fields_that_do_not_apply_are_400s(fields: dict, param: str) -> None:
    with pytest.raises(APIError) as err:
        parse(**fields)
    assert err.value.status == 400 and err.value.param == param


def test_an_image_part_is_a_400() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    body = json.dumps({"messages": [{"role": "user", "content": [image]}]}).encode()
    with pytest.raises(APIError, match="only text parts"):
        parse_chat_request(body, "application/json", model=MODEL)


def test_info_lists_the_fields() -> None:
    info = renoise_info(MODEL)
    assert info["modes"] == ["diffusion"] and info["max_denoising_steps"] == 48
    assert "num_denoising_steps" in info["fields"] and "temperature" in info["refused_fields"]
    assert renoise_info(ModelDecoding("diffusion")) == {}
