"""The ``decoding_mode`` extension field: a tri-mode model decodes each request by the mode it
names (else the server's default); any other model has one mode, and naming another is a 400
whose body names the model's mode (exact bodies pinned here)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dllm_serve.api.errors import APIError
from dllm_serve.api.pipeline import parse_chat_request, parse_completion_request
from dllm_serve.api.rules import ModelDecoding

JSON = "application/json"


def spec(**fields: Any):
    raw = json.dumps({"messages": [{"role": "user", "content": "hi"}], **fields}).encode()
    return parse_chat_request(raw, JSON)


def parse(kind: str, block: int | None, default: str | None, **fields: Any):  # type: ignore[no-untyped-def]
    """The request parsed for a model of algorithm ``kind`` (the mode rules run inside)."""
    raw = json.dumps({"messages": [{"role": "user", "content": "hi"}], **fields}).encode()
    return parse_chat_request(raw, JSON, model=ModelDecoding(kind, block, default))


def error(kind: str, block: int | None, default: str | None, **fields: Any) -> dict[str, Any]:
    with pytest.raises(APIError) as info:
        parse(kind, block, default, **fields)
    assert info.value.status == 400
    return info.value.body()


def body(message: str, param: str) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": param,
            "code": "not_applicable",
        }
    }


@pytest.mark.parametrize(
    ("kind", "own", "what"),
    [
        ("diffusion", "diffusion", "diffusion: masked positions denoised in parallel"),
        ("block_diffusion", "diffusion", "diffusion: masked positions denoised in parallel"),
        (
            "self_speculation",
            "isd",
            "I-DLM introspective strided decoding (exact self-speculation)",
        ),
    ],
)
@pytest.mark.parametrize("asked", ["ar", "linear_spec", "diffusion", "isd"])
def test_single_mode_models_accept_only_their_mode(
    kind: str, own: str, what: str, asked: str
) -> None:
    if asked == own:
        parse(kind, 4, own, decoding_mode=asked)
        return
    assert error(kind, 4, own, decoding_mode=asked) == body(
        f"'decoding_mode' '{asked}' is not available for this model: it decodes only by "
        f"'{own}' ({what}). Omit 'decoding_mode' or set it to '{own}'.",
        "decoding_mode",
    )


def test_tri_mode_models_take_ar_diffusion_and_linear_spec() -> None:
    for mode in ("ar", "diffusion", "linear_spec"):
        parsed = parse("tri_mode", 32, "linear_spec", decoding_mode=mode, max_tokens=16)
        assert parsed.params.decoding_mode == mode
    assert spec().params.decoding_mode is None  # the engine applies the server's default
    assert error("tri_mode", 32, "ar", decoding_mode="isd") == body(
        "'decoding_mode' 'isd' is not available for this model: it is a tri-mode model and "
        "decodes by 'ar', 'diffusion' or 'linear_spec'. Omit 'decoding_mode' to use the "
        "server's default ('ar').",
        "decoding_mode",
    )


def test_diffusion_fields_follow_the_requests_mode() -> None:
    steps = {"num_denoising_steps": 8, "max_tokens": 16}
    parse("tri_mode", 32, "ar", decoding_mode="diffusion", **steps)
    parse("tri_mode", 32, "diffusion", **steps)  # the default mode
    assert error("tri_mode", 32, "diffusion", decoding_mode="ar", **steps) == body(
        "'num_denoising_steps' configures diffusion denoising, but this request decodes by "
        "'ar' (autoregressive: causal decoding with a KV cache, one token per forward): it has "
        "no denoising steps, blocks, schedules or commit thresholds. Omit it, or set "
        "'decoding_mode': 'diffusion'.",
        "num_denoising_steps",
    )
    assert error("tri_mode", 32, "linear_spec", confidence_threshold=0.9) == body(
        "'confidence_threshold' configures diffusion denoising, but this request decodes by "
        "'linear_spec' (LinearSpec: a block drafted in the diffusion view, verified causally): "
        "it has no denoising steps, blocks, schedules or commit thresholds. Omit it, or set "
        "'decoding_mode': 'diffusion'.",
        "confidence_threshold",
    )
    assert error(
        "tri_mode", 32, "linear_spec", decoding_mode="diffusion", block_length=8, max_tokens=16
    ) == body(
        "'block_length' must be 32 for this model: its diffusion mode decodes in the block it "
        "was trained with (bidirectional inside a block, causal across blocks), and other "
        "blocks are not what it learned. Omit it.",
        "block_length",
    )


def test_unknown_modes_are_a_400_from_the_schema() -> None:
    raw = json.dumps({"prompt": "hi", "decoding_mode": "fast"}).encode()
    with pytest.raises(APIError) as info:
        parse_completion_request(raw, JSON)
    assert (info.value.status, info.value.param) == (400, "decoding_mode")


@pytest.mark.parametrize(
    ("kind", "default", "fields"),
    [("self_speculation", "isd", {}), ("tri_mode", "linear_spec", {"decoding_mode": "ar"})],
)
def test_a_local_leap_setting_where_no_denoising_runs_is_not_applicable(
    kind: str, default: str, fields: dict
) -> None:
    # Found by QA: it was told to set use_local_leap (code null), which then was refused.
    got = error(kind, 4, default, local_leap_radius=4, **fields)
    assert got["error"]["code"] == "not_applicable"
    assert got["error"]["param"] == "local_leap_radius"
    assert got["error"]["message"].startswith(
        "'local_leap_radius' configures diffusion denoising, but this "
    )
    # Where denoising runs, the LocalLeap switch rule still applies.
    switch = error("diffusion", None, "diffusion", local_leap_radius=4)
    assert switch["error"]["message"] == (
        "'local_leap_radius' configures LocalLeap; set 'use_local_leap': true to use it."
    )
