"""The request table of docs/api-contract.md: every row is a body and what the server must
answer."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dllm_serve.api.errors import APIError
from dllm_serve.api.pipeline import check_context_length, parse_chat_request
from dllm_serve.api.protocol import ChatCompletionRequest
from dllm_serve.api.rules import ModelDecoding
from dllm_serve.decoding.params import DecodingParams

MSG = [{"role": "user", "content": "hi"}]
JSON = "application/json"
CONTRACT = "see docs/api-contract.md"  # every refused OpenAI field points there


def body(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "messages": MSG, **fields}).encode()


# (id, raw body, content type, expected param, substring of the message)
BAD: list[tuple[str, bytes, str | None, str | None, str]] = [
    ("not-json", b"{nope", JSON, None, "could not parse the JSON body"),
    ("truncated", b'{"messages": [', JSON, None, "could not parse the JSON body"),
    ("empty-body", b"", JSON, None, "could not parse the JSON body"),
    ("invalid-utf8", b'{"messages": "\xff"}', JSON, None, "could not parse the JSON body"),
    ("deep-nesting", b"[" * 5000 + b"]" * 5000, JSON, None, "could not parse the JSON body"),
    ("array-body", b"[1, 2]", JSON, None, "must be a JSON object"),
    ("text-plain", body(), "text/plain", None, "Unsupported Content-Type 'text/plain'"),
    ("form", body(), "application/x-www-form-urlencoded", None, "Unsupported Content-Type"),
    ("no-content-type", body(), None, None, "No Content-Type: the request body must be JSON"),
    ("unknown-field", body(foo=1), JSON, "foo", "Unrecognized request argument supplied: foo"),
    (
        "unknown-msg-field",
        body(messages=[{"role": "user", "content": "x", "tool_id": "a"}]),
        JSON,
        "messages[0].tool_id",
        "Unrecognized request argument supplied: messages[0].tool_id",
    ),
    (
        "tool-call-id-on-a-user-message",
        body(messages=[{"role": "user", "content": "x", "tool_call_id": "a"}]),
        JSON,
        "messages[0].tool_call_id",
        "Only tool messages carry 'tool_call_id'",
    ),
    (
        "missing-messages",
        json.dumps({"model": "m"}).encode(),
        JSON,
        "messages",
        "Missing required parameter: 'messages'",
    ),
    ("empty-messages", body(messages=[]), JSON, "messages", "at least one message"),
    ("messages-not-list", body(messages="hi"), JSON, "messages", "Invalid value for 'messages'"),
    (
        "bad-role",
        body(messages=[{"role": "function", "content": "x"}]),
        JSON,
        "messages[0].role",
        "Invalid value for 'messages[0].role'",
    ),
    (
        "missing-role",
        body(messages=[{"content": "x"}]),
        JSON,
        "messages[0].role",
        "Missing required parameter: 'messages[0].role'",
    ),
    (
        "null-content",
        body(messages=[{"role": "user", "content": None}]),
        JSON,
        "messages[0].content",
        "content must be a string",
    ),
    (
        "int-content",
        body(messages=[{"role": "user", "content": 3}]),
        JSON,
        "messages[0].content",
        "content must be a string",
    ),
    (
        "image-part",
        body(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
        JSON,
        "messages[0].content[0]",
        "only text parts",
    ),
    (
        "part-bad-text",
        body(messages=[{"role": "user", "content": [{"type": "text", "text": 1}]}]),
        JSON,
        "messages[0].content[0]",
        "'text' is a string",
    ),
    ("temperature-high", body(temperature=2.5), JSON, "temperature", "less than or equal to 2"),
    ("temperature-neg", body(temperature=-0.1), JSON, "temperature", "greater than or equal to 0"),
    ("temperature-str", body(temperature="0.5"), JSON, "temperature", "valid number"),
    (
        "temperature-nan",
        b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
        JSON,
        "temperature",
        "Invalid value for 'temperature'",
    ),
    ("seed-float", body(seed=1.5), JSON, "seed", "valid integer"),
    ("seed-huge", body(seed=2**70), JSON, "seed", "less than or equal to"),
    ("stream-str", body(stream="yes"), JSON, "stream", "valid boolean"),
    ("max-tokens-zero", body(max_tokens=0), JSON, "max_tokens", "greater than or equal to 1"),
    ("max-tokens-str", body(max_tokens="64"), JSON, "max_tokens", "valid integer"),
    (
        "max-tokens-conflict",
        body(max_tokens=64, max_completion_tokens=32),
        JSON,
        "max_completion_tokens",
        "different values",
    ),
    ("top-p", body(top_p=0.9), JSON, "top_p", CONTRACT),
    ("top-p-range", body(top_p=1.5), JSON, "top_p", "less than or equal to 1"),
    ("top-k", body(top_k=40), JSON, "top_k", CONTRACT),
    ("n-200", body(n=200), JSON, "n", "less than or equal to 128"),  # OpenAI's bound
    ("top-logprobs-25", body(logprobs=True, top_logprobs=25), JSON, "top_logprobs", "less than"),
    ("n-0", body(n=0), JSON, "n", "greater than or equal to 1"),
    ("presence-penalty", body(presence_penalty=0.5), JSON, "presence_penalty", CONTRACT),
    ("frequency-penalty", body(frequency_penalty=-1), JSON, "frequency_penalty", CONTRACT),
    ("logit-bias", body(logit_bias={"42": 5}), JSON, "logit_bias", CONTRACT),
    ("logprobs-str", body(logprobs="yes"), JSON, "logprobs", "valid boolean"),
    ("top-logprobs-alone", body(top_logprobs=3), JSON, "top_logprobs", "needs 'logprobs': true"),
    (
        "tools-not-functions",
        body(tools=[{"type": "code_interpreter"}]),
        JSON,
        "tools[0]",
        "must be a function tool",
    ),
    ("tool-choice-without-tools", body(tool_choice="auto"), JSON, "tool_choice", "needs 'tools'"),
    ("functions", body(functions=[{"name": "f"}]), JSON, "functions", CONTRACT),
    ("stop-too-many", body(stop=["a", "b", "c", "d", "e"]), JSON, "stop", "at most 4"),
    ("stop-empty", body(stop=["ok", ""]), JSON, "stop[1]", "must not be empty"),
    ("stop-int", body(stop=5), JSON, "stop", "Invalid value for 'stop'"),
    (
        "response-format-type",
        body(response_format={"type": "yaml"}),
        JSON,
        "response_format",
        "use 'text', 'json_object' or 'json_schema'",
    ),
    (
        "json-schema-unimplemented-keyword",
        body(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "not": {}}},
            }
        ),
        JSON,
        "response_format",
        'Unimplemented keys: ["not"]',
    ),
    (
        "stream-options-no-stream",
        body(stream_options={"include_usage": True}),
        JSON,
        "stream_options",
        "only allowed when 'stream' is true",
    ),
    (
        "stream-options-unknown",
        body(stream=True, stream_options={"x": 1}),
        JSON,
        "stream_options.x",
        "Unrecognized request argument",
    ),
    (
        "steps-zero",
        body(num_denoising_steps=0),
        JSON,
        "num_denoising_steps",
        "greater than or equal to 1",
    ),
    (
        "steps-513",
        body(num_denoising_steps=513),
        JSON,
        "num_denoising_steps",
        "less than or equal to 512",
    ),
    (
        "block-not-dividing",
        body(max_tokens=64, block_length=24),
        JSON,
        "block_length",
        "must divide the canvas length (64)",
    ),
    (
        "block-longer-than-canvas",
        body(max_tokens=32, block_length=64),
        JSON,
        "block_length",
        "must divide",
    ),
    (
        "steps-not-multiple",
        body(max_tokens=64, block_length=16, num_denoising_steps=30),
        JSON,
        "num_denoising_steps",
        "multiple of the number of blocks (4",
    ),
    (
        "too-many-blocks",
        body(max_tokens=1024, block_length=1),
        JSON,
        "block_length",
        "at most 512 blocks",
    ),
    (
        "bad-schedule-name",
        body(block_schedule="linear"),
        JSON,
        "block_schedule",
        "Invalid value for 'block_schedule'",
    ),
    (
        "metric-unknown",
        body(confidence_metric="margin"),
        JSON,
        "confidence_metric",
        "Invalid value",
    ),
    (
        "target-over-max",
        body(max_tokens=32, target_length=64),
        JSON,
        "target_length",
        "exceeds max_tokens",
    ),
    (
        "target-over-max-completion",
        body(max_completion_tokens=8, target_length=16),
        JSON,
        "target_length",
        "exceeds max_completion_tokens (8)",
    ),
    ("target-zero", body(target_length=0), JSON, "target_length", "greater than or equal to 1"),
    ("fa2", body(attention_backend="fa2"), JSON, "attention_backend", "deferred"),
    (
        "backend-unknown",
        body(attention_backend="xformers"),
        JSON,
        "attention_backend",
        "Invalid value",
    ),
    ("force-single-int", body(force_single_batch=1), JSON, "force_single_batch", "valid boolean"),
    (
        "leap-anchor-range",
        body(local_leap_anchor_threshold=1.5),
        JSON,
        "local_leap_anchor_threshold",
        "less than or equal to 1",
    ),
    (
        "leap-radius-range",
        body(local_leap_radius=17),
        JSON,
        "local_leap_radius",
        "less than or equal to 16",
    ),
    (
        "leap-radius-without-leap",
        body(local_leap_radius=4),
        JSON,
        "local_leap_radius",
        "configures LocalLeap",
    ),
    (
        "leap-anchor-with-leap-off",
        body(use_local_leap=False, local_leap_anchor_threshold=0.8),
        JSON,
        "local_leap_anchor_threshold",
        "set 'use_local_leap': true",
    ),
    (
        "leap-radius-zero",
        body(use_local_leap=True, local_leap_radius=0),
        JSON,
        "local_leap_radius",
        "greater than or equal to 1",
    ),
    (
        "leap-neighbor-negative",
        body(use_local_leap=True, local_leap_neighbor_threshold=-0.1),
        JSON,
        "local_leap_neighbor_threshold",
        "greater than or equal to 0",
    ),
    (
        "leap-tau-over-kappa",
        body(
            use_local_leap=True, local_leap_anchor_threshold=0.6, local_leap_neighbor_threshold=0.7
        ),
        JSON,
        "local_leap_neighbor_threshold",
        "must not exceed 'local_leap_anchor_threshold' (0.6)",
    ),
    (
        "leap-default-tau-over-kappa",
        body(use_local_leap=True, local_leap_anchor_threshold=0.7),
        JSON,
        "local_leap_neighbor_threshold",
        "(0.75) must not exceed",
    ),
    (
        "leap-with-cosine",
        body(use_local_leap=True, block_schedule="cosine"),
        JSON,
        "block_schedule",
        "has no effect with 'use_local_leap'",
    ),
    (
        "leap-steps-not-multiple",
        body(use_local_leap=True, max_tokens=64, block_length=16, num_denoising_steps=6),
        JSON,
        "num_denoising_steps",
        "multiple of the number of blocks",
    ),
    (
        "threshold-zero",
        body(confidence_threshold=0),
        JSON,
        "confidence_threshold",
        "greater than 0",
    ),
    (
        "threshold-over-one",
        body(confidence_threshold=1.01),
        JSON,
        "confidence_threshold",
        "less than or equal to 1",
    ),
    (
        "threshold-str",
        body(confidence_threshold="0.9"),
        JSON,
        "confidence_threshold",
        "valid number",
    ),
    (
        "threshold-with-leap",
        body(confidence_threshold=0.9, use_local_leap=True),
        JSON,
        "confidence_threshold",
        "mutually exclusive",
    ),
    (
        "threshold-with-front-loaded",
        body(confidence_threshold=0.9, block_schedule="front_loaded"),
        JSON,
        "block_schedule",
        "has no effect with 'confidence_threshold'",
    ),
    ("entropy-bound-negative", body(entropy_bound=-1), JSON, "entropy_bound", "greater than or"),
    ("entropy-threshold-zero", body(entropy_threshold=0), JSON, "entropy_threshold", "greater"),
    (
        "entropy-bound-with-threshold",
        body(entropy_bound=0.1, confidence_threshold=0.9),
        JSON,
        "confidence_threshold",
        "'entropy_bound' and 'confidence_threshold' choose different commit rules",
    ),
    (
        "entropy-with-metric",
        body(entropy_threshold=1.0, confidence_metric="entropy_inverse"),
        JSON,
        "confidence_metric",
        "ranks positions by the entropy",
    ),
    (
        "entropy-with-cosine",
        body(entropy_bound=0.1, block_schedule="cosine"),
        JSON,
        "block_schedule",
        "has no effect with 'entropy_bound'",
    ),
    ("edit-over-one", body(edit_threshold=1.5), JSON, "edit_threshold", "less than or equal to 1"),
    (
        "edit-with-leap",
        body(edit_threshold=0.5, use_local_leap=True),
        JSON,
        "use_local_leap",
        "choose different commit rules",
    ),
    (
        "post-edit-steps-alone",
        body(max_post_edit_steps=3),
        JSON,
        "max_post_edit_steps",
        "set 'edit_threshold' to use it",
    ),
    ("model-int", body(model=5), JSON, "model", "valid string"),
    # Still rejected: what diffusion decoding cannot honour (issue 15 keeps these 400s).
    ("store-true", body(store=True), JSON, "store", "stores nothing"),
    ("service-tier-flex", body(service_tier="flex"), JSON, "service_tier", "'flex' is not"),
    ("service-tier-priority", body(service_tier="priority"), JSON, "service_tier", "one tier"),
    ("modalities-audio", body(modalities=["text", "audio"]), JSON, "modalities", "text"),
    ("modalities-empty", body(modalities=[]), JSON, "modalities", "other than text"),
    ("audio", body(audio={"voice": "alloy", "format": "mp3"}), JSON, "audio", "Only null"),
    (
        "prediction",
        body(prediction={"type": "content", "content": "x"}),
        JSON,
        "prediction",
        "null",
    ),
    ("reasoning-effort", body(reasoning_effort="low"), JSON, "reasoning_effort", "no reasoning"),
    ("min-tokens", body(min_tokens=5), JSON, "min_tokens", "Only 0 is accepted"),
    ("min-tokens-neg", body(min_tokens=-1), JSON, "min_tokens", "greater than or equal to 0"),
    ("repetition-penalty", body(repetition_penalty=1.1), JSON, "repetition_penalty", "Only 1"),
    ("repetition-penalty-0", body(repetition_penalty=0), JSON, "repetition_penalty", "greater"),
    ("skip-special-false", body(skip_special_tokens=False), JSON, "skip_special_tokens", "true"),
    ("echo-true", body(echo=True), JSON, "echo", "Only false is accepted"),
    ("best-of-2", body(best_of=2), JSON, "best_of", "best_of=1"),
    ("ignore-eos-str", body(ignore_eos="yes"), JSON, "ignore_eos", "valid boolean"),
    ("stop-token-ids-str", body(stop_token_ids=["a"]), JSON, "stop_token_ids[0]", "integer"),
    (
        "include-stop-str-int",
        body(include_stop_str_in_output=1),
        JSON,
        "include_stop_str_in_output",
        "valid boolean",
    ),
    ("parallel-tool-calls-str", body(parallel_tool_calls="y"), JSON, "parallel_tool_calls", "bool"),
    ("metadata-not-str", body(metadata={"k": 1}), JSON, "metadata.k", "valid string"),
    (
        "continuous-usage-no-stream",
        body(stream_options={"include_usage": True, "continuous_usage_stats": True}),
        JSON,
        "stream_options",
        "only allowed when 'stream' is true",
    ),
    (
        "tool-calls-in-history",
        body(messages=[{"role": "assistant", "content": "x", "tool_calls": [{"id": "c"}]}]),
        JSON,
        "messages[0].tool_calls[0]",
        '"function": {"name": str, "arguments": str}',
    ),
    (
        "refusal-text",
        body(messages=[{"role": "assistant", "content": "x", "refusal": "no"}]),
        JSON,
        "messages[0].refusal",
        "'messages[0].refusal' must be null: this server never returns one",
    ),
    (
        "function-call-in-history",
        body(messages=[{"role": "assistant", "content": "x", "function_call": {"name": "f"}}]),
        JSON,
        "messages[0].function_call",
        "the legacy functions API is not (use 'tool_calls'). Only null is accepted",
    ),
    (
        "audio-in-history",
        body(messages=[{"role": "assistant", "content": "x", "audio": {"id": "a"}}]),
        JSON,
        "messages[0].audio",
        "must be null",
    ),
    (
        "annotations-in-history",
        body(messages=[{"role": "assistant", "content": "x", "annotations": [{"type": "u"}]}]),
        JSON,
        "messages[0].annotations",
        "must be null or []",
    ),
    (
        "name-int",
        body(messages=[{"role": "user", "content": "x", "name": 3}]),
        JSON,
        "messages[0].name",
        "valid string",
    ),
    (
        "tool-choice-unknown-function",
        body(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        JSON,
        "tool_choice",
        "one of the tools",
    ),
    ("function-call-auto", body(function_call="auto"), JSON, "function_call", CONTRACT),
    (
        "json-schema-without-schema",
        body(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        JSON,
        "response_format",
        "'json_schema.schema' must be a JSON Schema object",
    ),
    ("messages-null", body(messages=None), JSON, "messages", "valid array"),
    (
        "function-call-empty-list-in-history",
        body(messages=[{"role": "assistant", "content": "x", "function_call": []}]),
        JSON,
        "messages[0].function_call",
        "Only null is accepted",
    ),
]


@pytest.mark.parametrize(
    ("raw", "ctype", "param", "message"), [r[1:] for r in BAD], ids=[r[0] for r in BAD]
)
def test_rejected_with_400(raw: bytes, ctype: str | None, param: str | None, message: str) -> None:
    with pytest.raises(APIError) as info:
        parse_chat_request(raw, ctype)
    err = info.value
    assert err.status == 400
    assert err.type == "invalid_request_error"
    assert err.param == param
    assert message in err.message
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}


# (id, body, expected (gen_length, steps, block_length, temperature, seed), stream, usage)
GOOD: list[tuple[str, bytes, tuple[int, int, int, float, int | None], bool, bool]] = [
    ("defaults", body(), (128, 128, 128, 0.0, None), False, False),
    ("no-model", json.dumps({"messages": MSG}).encode(), (128, 128, 128, 0.0, None), False, False),
    ("max-tokens", body(max_tokens=32), (32, 32, 32, 0.0, None), False, False),
    (
        "max-completion-tokens",
        body(max_completion_tokens=48),
        (48, 48, 48, 0.0, None),
        False,
        False,
    ),
    (
        "both-max-equal",
        body(max_tokens=16, max_completion_tokens=16),
        (16, 16, 16, 0.0, None),
        False,
        False,
    ),
    ("big-canvas-default-steps", body(max_tokens=256), (256, 128, 256, 0.0, None), False, False),
    (
        "blocks-default-steps-rounded",
        body(max_tokens=192, block_length=64),
        (192, 126, 64, 0.0, None),
        False,
        False,
    ),
    (
        "blocks",
        body(max_tokens=64, block_length=16, num_denoising_steps=32),
        (64, 32, 16, 0.0, None),
        False,
        False,
    ),
    (
        "steps-over-canvas",
        body(max_tokens=8, num_denoising_steps=16),
        (8, 16, 8, 0.0, None),
        False,
        False,
    ),
    ("target-length", body(target_length=40), (40, 40, 40, 0.0, None), False, False),
    (
        "target-with-larger-max",
        body(target_length=40, max_tokens=64),
        (40, 40, 40, 0.0, None),
        False,
        False,
    ),
    ("sampling", body(temperature=0.7, seed=1234), (128, 128, 128, 0.7, 1234), False, False),
    ("negative-seed", body(seed=-5, temperature=1), (128, 128, 128, 1.0, -5), False, False),
    ("top-k-1-is-greedy", body(top_k=1, temperature=1.5), (128, 128, 128, 0.0, None), False, False),
    (
        "no-ops",
        body(
            top_p=1,
            n=1,
            presence_penalty=0,
            frequency_penalty=0.0,
            logit_bias={},
            logprobs=False,
            tools=[],
            tool_choice="none",
            top_k=0,
            user="u",
        ),
        (128, 128, 128, 0.0, None),
        False,
        False,
    ),
    (
        "nulls",
        body(top_p=None, n=None, stop=None, seed=None, temperature=None),
        (128, 128, 128, 0.0, None),
        False,
        False,
    ),
    (
        "text-format",
        body(response_format={"type": "text"}),
        (128, 128, 128, 0.0, None),
        False,
        False,
    ),
    ("stream", body(stream=True), (128, 128, 128, 0.0, None), True, False),
    (
        "stream-usage",
        body(stream=True, stream_options={"include_usage": True}),
        (128, 128, 128, 0.0, None),
        True,
        True,
    ),
    (
        "extensions-at-defaults",
        body(
            block_schedule="uniform",
            confidence_metric="top1_prob",
            attention_backend="sdpa",
            use_local_leap=False,
            force_single_batch=True,
        ),
        (128, 128, 128, 0.0, None),
        False,
        False,
    ),
    ("charset", body(), (128, 128, 128, 0.0, None), False, False),
    (
        "continuous-usage",
        body(stream=True, stream_options={"continuous_usage_stats": True, "include_usage": None}),
        (128, 128, 128, 0.0, None),
        True,
        False,
    ),
]


@pytest.mark.parametrize(
    ("raw", "expected", "stream", "usage"), [r[1:] for r in GOOD], ids=[r[0] for r in GOOD]
)
def test_accepted(raw: bytes, expected: tuple, stream: bool, usage: bool) -> None:
    spec = parse_chat_request(raw, "application/json; charset=utf-8")
    p = spec.params
    assert (p.gen_length, p.steps, p.block_length, p.temperature, p.seed) == expected
    assert p.gen_length % p.block_length == 0 and p.steps % p.num_blocks == 0
    assert (spec.stream, spec.include_usage) == (stream, usage)


LEAP_DEFAULTS = {
    "local_leap_anchor_threshold": 0.9,
    "local_leap_neighbor_threshold": 0.75,
    "local_leap_radius": 4,
}
# (id, body, DecodingParams fields the request must produce; unnamed ones keep their defaults)
DECODING: list[tuple[str, bytes, dict[str, Any]]] = [
    ("default-mode", body(), {"mode": "topk", "block_schedule": "uniform"}),
    ("schedule-cosine", body(block_schedule="cosine"), {"block_schedule": "cosine"}),
    (
        "schedule-front-loaded",
        body(block_schedule="front_loaded", max_tokens=64, block_length=16),
        {"block_schedule": "front_loaded", "steps": 64, "block_length": 16},
    ),
    (
        "metric-entropy",
        body(confidence_metric="entropy_inverse"),
        {"confidence_metric": "entropy_inverse", "mode": "topk"},
    ),
    (
        "local-leap-defaults",
        body(use_local_leap=True),
        {
            "use_local_leap": True,
            "mode": "local_leap",
            "confidence_threshold": None,
            **LEAP_DEFAULTS,
        },
    ),
    (
        "local-leap-custom",
        body(
            use_local_leap=True,
            local_leap_anchor_threshold=0.8,
            local_leap_neighbor_threshold=0.5,
            local_leap_radius=16,
            confidence_metric="entropy_inverse",
        ),
        {
            "mode": "local_leap",
            "local_leap_anchor_threshold": 0.8,
            "local_leap_neighbor_threshold": 0.5,
            "local_leap_radius": 16,
            "confidence_metric": "entropy_inverse",
        },
    ),
    (
        "local-leap-tau-equals-kappa",
        body(use_local_leap=True, local_leap_anchor_threshold=0.75, block_schedule="uniform"),
        {"mode": "local_leap", "local_leap_anchor_threshold": 0.75},
    ),
    (
        "local-leap-off-explicit",
        body(use_local_leap=False),
        {"use_local_leap": False, "mode": "topk", **LEAP_DEFAULTS},
    ),
    (
        "threshold",
        body(confidence_threshold=0.9, max_tokens=64, block_length=32),
        {"confidence_threshold": 0.9, "mode": "threshold", "steps": 64, "use_local_leap": False},
    ),
    ("threshold-one", body(confidence_threshold=1), {"confidence_threshold": 1.0}),
    (
        "threshold-null",
        body(confidence_threshold=None, use_local_leap=None),
        {"confidence_threshold": None, "mode": "topk"},
    ),
    ("entropy-bound", body(entropy_bound=0.15), {"entropy_bound": 0.15, "mode": "entropy_bound"}),
    ("entropy-threshold", body(entropy_threshold=0.95), {"mode": "entropy_threshold"}),
    (
        "edit",
        body(edit_threshold=0.0, confidence_threshold=0.7, max_post_edit_steps=4),
        {"mode": "joint_threshold", "mask_threshold": 0.7, "max_post_edit_steps": 4},
    ),
    (
        "edit-defaults",
        body(edit_threshold=0.5),
        {"edit_threshold": 0.5, "mask_threshold": 0.5, "max_post_edit_steps": 16},
    ),
]


@pytest.mark.parametrize(
    ("raw", "expected"), [r[1:] for r in DECODING], ids=[r[0] for r in DECODING]
)
def test_decoding_fields_reach_params(raw: bytes, expected: dict[str, Any]) -> None:
    params = parse_chat_request(raw, JSON).params
    assert {name: getattr(params, name) for name in expected} == expected


def test_table_is_large_enough() -> None:
    assert len(BAD) + len(GOOD) + len(DECODING) >= 40


def test_content_parts_are_joined_and_roles_kept() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "ok"},
    ]
    spec = parse_chat_request(body(messages=messages), JSON)
    assert spec.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "ok"},
    ]


def test_force_single_batch_reaches_params() -> None:
    assert parse_chat_request(body(force_single_batch=True), JSON).params.force_single_batch


def test_context_length() -> None:
    check_context_length(100, 28, 128)
    with pytest.raises(APIError) as info:
        check_context_length(100, 29, 128)
    assert (info.value.param, info.value.code) == ("max_tokens", "context_length_exceeded")
    with pytest.raises(APIError) as info:
        check_context_length(130, 1, 128)
    assert info.value.param == "messages"


def test_stop_strings_are_accepted() -> None:
    assert parse_chat_request(body(stop="END"), JSON).stop == ("END",)
    assert parse_chat_request(body(stop=["\n\n", "###"]), JSON).stop == ("\n\n", "###")
    assert parse_chat_request(body(stop=None), JSON).stop == ()


def test_denoising_fields_are_rejected_for_self_speculative_models() -> None:
    isd, llada = ModelDecoding("self_speculation"), ModelDecoding("diffusion")
    # Nothing diffusion-only: fine.
    parse_chat_request(body(max_tokens=16, temperature=0.5, stop="x"), JSON, model=isd)
    parse_chat_request(body(num_denoising_steps=8, max_tokens=16), JSON, model=llada)
    with pytest.raises(APIError) as info:
        parse_chat_request(body(num_denoising_steps=8, max_tokens=16), JSON, model=isd)
    assert (info.value.status, info.value.param) == (400, "num_denoising_steps")
    assert info.value.code == "not_applicable"


# Every optional OpenAI (and vLLM / diffusion extension) field sent as null = left out.
NULLABLE = [name for name in ChatCompletionRequest.model_fields if name != "messages"]


def test_every_optional_field_may_be_null() -> None:
    assert len(NULLABLE) > 50
    spec = parse_chat_request(body(**dict.fromkeys(NULLABLE)), JSON)
    assert spec.params == parse_chat_request(body(), JSON).params
    assert (spec.stream, spec.include_usage, spec.stop, spec.info) == (False, False, (), {})
    assert not spec.continuous_usage and not spec.include_stop_str
    options = dict.fromkeys(("include_usage", "include_obfuscation", "continuous_usage_stats"))
    assert parse_chat_request(body(stream=True, stream_options=options), JSON).stream


# Accepted no-op values (issue 15): each leaves the decoding parameters at their defaults.
NO_OPS: list[tuple[str, dict[str, Any]]] = [
    ("store-false", {"store": False}),
    ("service-tier-auto", {"service_tier": "auto"}),
    ("service-tier-default", {"service_tier": "default"}),
    ("modalities-text", {"modalities": ["text"]}),
    ("metadata", {"metadata": {"team": "eval", "run": "7"}}),
    ("prompt-cache-key", {"prompt_cache_key": "k"}),
    ("safety-identifier", {"safety_identifier": "hash-1"}),
    ("user", {"user": "u"}),
    ("parallel-tool-calls-true", {"parallel_tool_calls": True}),
    ("parallel-tool-calls-false", {"parallel_tool_calls": False}),
    ("min-tokens-0", {"min_tokens": 0}),
    ("repetition-penalty-1", {"repetition_penalty": 1}),
    ("repetition-penalty-1.0", {"repetition_penalty": 1.0}),
    ("skip-special-tokens", {"skip_special_tokens": True}),
    ("echo-false", {"echo": False}),
    ("best-of-1", {"best_of": 1}),
    ("ignore-eos-false", {"ignore_eos": False}),
    ("include-stop-str-false", {"include_stop_str_in_output": False}),
    ("stop-token-ids-empty", {"stop_token_ids": []}),
    ("tool-choice-none", {"tool_choice": "none"}),
    ("function-call-none", {"function_call": "none"}),
    ("functions-empty", {"functions": []}),
    ("top-logprobs-0", {"top_logprobs": 0}),
    ("audio-null", {"audio": None}),
    ("prediction-null", {"prediction": None}),
    ("reasoning-effort-null", {"reasoning_effort": None}),
    ("response-format-null", {"response_format": None}),
]


@pytest.mark.parametrize("fields", [r[1] for r in NO_OPS], ids=[r[0] for r in NO_OPS])
def test_no_op_values_are_accepted(fields: dict[str, Any]) -> None:
    assert parse_chat_request(body(**fields), JSON).params == DecodingParams(
        gen_length=128, steps=128
    )


def test_informational_fields_are_kept_for_the_request_log() -> None:
    spec = parse_chat_request(
        body(
            metadata={"a": "b"},
            prompt_cache_key="k",
            safety_identifier="s",
            user="u",
            parallel_tool_calls=False,
        ),
        JSON,
    )
    assert spec.info == {
        "user": "u",
        "metadata": {"a": "b"},
        "prompt_cache_key": "k",
        "safety_identifier": "s",
        "parallel_tool_calls": False,
    }


def test_returned_assistant_message_is_accepted_back() -> None:
    """The SDK's own reply (``message.model_dump()``) appended to the history (issue 15)."""
    returned = {
        "role": "assistant",
        "content": "579",
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "tool_calls": None,
    }
    history = [
        {"role": "developer", "content": "Answer briefly.", "name": None},
        {"role": "user", "content": "What is 123 + 456?", "name": "ann"},
        returned,
        {"role": "assistant", "content": "ok", "tool_calls": [], "annotations": []},
        {"role": "user", "content": "Thanks"},
    ]
    spec = parse_chat_request(body(messages=history), JSON)
    assert spec.messages == [
        {"role": "system", "content": "Answer briefly."},  # developer = system
        {"role": "user", "content": "What is 123 + 456?", "name": "ann"},
        {"role": "assistant", "content": "579"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "Thanks"},
    ]


def test_ignore_eos_and_stop_token_ids_reach_params() -> None:
    params = parse_chat_request(body(ignore_eos=True, stop_token_ids=[5, 7]), JSON).params
    assert (params.ignore_eos, params.stop_token_ids) == (True, (5, 7))
    spec = parse_chat_request(body(stop="x", include_stop_str_in_output=True), JSON)
    assert spec.include_stop_str and spec.stop == ("x",)


# (id, fields, model's recommended block, expected (gen_length, steps, block_length))
BLOCKS: list[tuple[str, dict[str, Any], int | None, tuple[int, int, int]]] = [
    ("no-recommendation", {"max_tokens": 256}, None, (256, 128, 256)),
    ("fits-one-block", {"max_tokens": 32}, 32, (32, 32, 32)),
    ("short", {"max_tokens": 8}, 32, (8, 8, 8)),
    ("long", {"max_tokens": 256}, 32, (256, 256, 32)),
    ("evalscope-2048", {"max_tokens": 2048}, 32, (2048, 2048, 32)),
    ("not-a-multiple", {"max_tokens": 100}, 32, (100, 100, 25)),
    ("prime", {"max_tokens": 257}, 32, (257, 128, 257)),
    ("block-128", {"max_tokens": 1024}, 128, (1024, 1024, 128)),
    ("client-block-wins", {"max_tokens": 256, "block_length": 64}, 32, (256, 128, 64)),
    ("client-steps-win", {"max_tokens": 256, "num_denoising_steps": 64}, 32, (256, 64, 32)),
    ("target-length", {"target_length": 96}, 32, (96, 96, 32)),
]


@pytest.mark.parametrize(
    ("fields", "block", "expected"), [r[1:] for r in BLOCKS], ids=[r[0] for r in BLOCKS]
)
def test_long_canvas_default_block(
    fields: dict[str, Any], block: int | None, expected: tuple[int, int, int]
) -> None:
    p = parse_chat_request(body(**fields), JSON, 32, block).params
    assert (p.gen_length, p.steps, p.block_length) == expected
    assert p.gen_length % p.block_length == 0 and p.steps % p.num_blocks == 0


def test_client_steps_must_still_divide_into_the_default_blocks() -> None:
    with pytest.raises(APIError) as info:
        parse_chat_request(body(max_tokens=256, num_denoising_steps=12), JSON, 32, 32)
    assert info.value.param == "num_denoising_steps"
    assert "multiple of the number of blocks (8" in info.value.message


@pytest.mark.parametrize(
    ("response_format", "grammar"),
    [
        ({"type": "text"}, False),
        ({"type": "json_object"}, True),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}, True),
    ],
)
def test_response_format_becomes_a_grammar(response_format: dict[str, Any], grammar: bool) -> None:
    """json_object / json_schema reach the decoder as a grammar (enforced there,
    tests/unit/decoding/test_structured_output.py); text as none."""
    spec = parse_chat_request(body(response_format=response_format), JSON)
    assert (spec.params.grammar is not None) is grammar


# (id, fields, expected (canvas, steps, block, answer_limit)) with the model's block of 32, for a
# canvas-denoising model (round_canvas): a canvas no block of 16-32 divides is rounded up.
ROUNDED = [
    ("prime-257", {"max_tokens": 257}, (288, 288, 32, 257)),
    ("1001", {"max_tokens": 1001}, (1024, 1024, 32, 1001)),
    ("just-over-a-block", {"max_tokens": 33}, (64, 64, 32, 33)),
    ("divisible-stays", {"max_tokens": 100}, (100, 100, 25, None)),
    ("one-block-stays", {"max_tokens": 31}, (31, 31, 31, None)),
    ("client-block-stays", {"max_tokens": 1001, "block_length": 1001}, (1001, 128, 1001, None)),
    ("target-length-stays", {"target_length": 1001}, (1001, 128, 1001, None)),
    ("client-steps", {"max_tokens": 257, "num_denoising_steps": 9 * 16}, (288, 144, 32, 257)),
]


@pytest.mark.parametrize(
    ("fields", "expected"), [r[1:] for r in ROUNDED], ids=[r[0] for r in ROUNDED]
)
def test_a_canvas_the_block_does_not_divide_is_rounded_up(
    fields: dict[str, Any], expected: tuple[int, int, int, int | None]
) -> None:
    spec = parse_chat_request(body(**fields), JSON, 32, 32, round_canvas=True)
    p = spec.params
    assert (p.gen_length, p.steps, p.block_length, p.answer_limit) == expected
    assert p.answer_budget == (fields.get("max_tokens") or fields.get("target_length"))
    # Without canvas denoising (self-speculation, block diffusion) nothing is rounded.
    plain = parse_chat_request(body(**fields), JSON, 32, 32).params
    assert plain.answer_limit is None and plain.gen_length == p.answer_budget
    assert (spec.unrounded is None) == (p.answer_limit is None)


def test_a_rounded_canvas_that_overflows_the_context_keeps_the_blocks_that_fit() -> None:
    spec = parse_chat_request(body(max_tokens=1001), JSON, 32, 32, round_canvas=True)
    assert spec.fitted(1000, 2048) is spec  # 1000 + 1024 fits: rounded
    fitted = spec.fitted(1040, 2048)  # 1040 + 1024 does not; 31 blocks (992) do
    p = fitted.params
    assert (p.gen_length, p.block_length, p.steps, p.answer_limit) == (992, 32, 992, None)
    assert fitted.unrounded is None
    # max_tokens itself does not fit: the context check refuses the client's own number.
    assert spec.fitted(2040, 2048).params.gen_length == 1001
    # With the client's step count, fewer blocks would change it: one unrounded block instead.
    stepped = parse_chat_request(
        body(max_tokens=1001, num_denoising_steps=32), JSON, 32, 32, round_canvas=True
    )
    assert stepped.params.gen_length == 1024
    fitted = stepped.fitted(1040, 2048)
    assert (fitted.params.gen_length, fitted.params.block_length) == (1001, 1001)
    assert fitted.params.steps == 32 and fitted.params.answer_limit is None
    assert stepped.fitted(1100, 2048).params.gen_length == 1001  # refused by the context check


@pytest.mark.parametrize("max_tokens", [2049, 3001])
def test_max_tokens_past_the_context_is_refused_not_shrunk(max_tokens: int) -> None:
    # Found by QA: a canvas no block divides used to be shrunk to the blocks that fit even
    # when max_tokens alone overflowed the context (200 with a 1984-token canvas).
    spec = parse_chat_request(body(max_tokens=max_tokens), JSON, 32, 32, round_canvas=True)
    fitted = spec.fitted(35, 2048)
    assert fitted.params.gen_length == max_tokens and fitted.params.answer_limit is None
    with pytest.raises(APIError) as info:
        check_context_length(35, fitted.params.gen_length, 2048)
    assert (info.value.param, info.value.code) == ("max_tokens", "context_length_exceeded")
    assert f"{max_tokens} in the completion canvas" in info.value.message


def test_a_canvas_rounded_past_the_block_limit_stays_one_block() -> None:
    # 16,385 would round to 513 blocks of 32, past the 512 allowed: it stays one block (the
    # context check then refuses it on any model shorter than that), never a 400 about a
    # block_length the client did not send.
    params = parse_chat_request(body(max_tokens=16385), JSON, 32, 32, round_canvas=True).params
    assert (params.gen_length, params.block_length, params.answer_limit) == (16385, 16385, None)
    params = parse_chat_request(body(max_tokens=16383), JSON, 32, 32, round_canvas=True).params
    assert (params.gen_length, params.block_length, params.answer_limit) == (16384, 32, 16383)


def test_client_steps_must_divide_into_the_rounded_canvas_blocks() -> None:
    spec = parse_chat_request(body(max_tokens=257, num_denoising_steps=10), JSON, 32, 32, True)
    with pytest.raises(APIError) as info:
        spec.fitted(35, 2048)  # the rounded canvas fits: its 9 blocks do not divide 10 steps
    assert info.value.param == "num_denoising_steps"
    assert info.value.message == (
        "'num_denoising_steps' (10) must be a multiple of the number of blocks (9 = canvas 288 "
        "/ block_length 32, the block the server chose for this canvas; send block_length to "
        "choose another)."
    )
    # Found by QA: a prompt that leaves no room for the rounding gets one unrounded block,
    # which any step count fits, so it is not refused on the blocks it will not use.
    fitted = spec.fitted(2048 - 257, 2048).params
    assert (fitted.gen_length, fitted.block_length, fitted.steps) == (257, 257, 10)


def test_token_editing_only_where_the_model_was_trained_to_edit() -> None:
    edit = body(edit_threshold=0.5, max_tokens=16)
    editing = ModelDecoding("block_diffusion", 4, token_editing=True)
    assert parse_chat_request(edit, JSON, model=editing).params.mode == "joint_threshold"
    for model, code in (
        (ModelDecoding("block_diffusion", 4), "not_applicable"),  # SDAR
        (ModelDecoding("diffusion"), "not_applicable"),  # LLaDA, Dream
        (ModelDecoding("self_speculation"), "not_applicable"),  # I-DLM: no denoising at all
    ):
        with pytest.raises(APIError) as info:
            parse_chat_request(edit, JSON, model=model)
        assert (info.value.status, info.value.param, info.value.code) == (
            400, "edit_threshold", code,
        )  # fmt: skip


def test_insert_delete_editing_is_greedy_and_records_no_logprobs() -> None:
    """LLaDA2.2 (JointThresholdInDel): temperature > 0 and logprobs with editing are a 400,
    whether the request or the model's preset asked for editing; without editing they pass."""
    indel = ModelDecoding(
        "block_diffusion", 4, token_editing=True, insert_delete=True,
        default_rule=(("confidence_threshold", 0.5), ("edit_threshold", 0.0)),
    )  # fmt: skip
    greedy = parse_chat_request(body(max_tokens=16), JSON, model=indel).params
    assert (greedy.mode, greedy.temperature) == ("joint_threshold", 0.0)
    for fields, param in (
        ({"temperature": 0.7}, "temperature"),
        ({"temperature": 0.7, "edit_threshold": 0.2}, "temperature"),
        ({"logprobs": True}, "logprobs"),
    ):
        with pytest.raises(APIError) as info:
            parse_chat_request(body(max_tokens=16, **fields), JSON, model=indel)
        assert (info.value.status, info.value.param, info.value.code) == (
            400, param, "not_applicable",
        )  # fmt: skip
        assert "JointThresholdInDel" in str(info.value)
    # Another commit rule samples (and records logprobs) as on any block model.
    own = body(max_tokens=16, temperature=0.7, confidence_threshold=0.9, logprobs=True)
    assert parse_chat_request(own, JSON, model=indel).params.mode == "threshold"


def test_info_lists_each_models_commit_rules() -> None:
    block = ModelDecoding("block_diffusion", 4)
    editing = ModelDecoding("block_diffusion", 32, token_editing=True)
    assert block.commit_rules() == [
        "topk", "threshold", "local_leap", "entropy_bound", "entropy_threshold",
    ]  # fmt: skip
    assert editing.commit_rules() == [*block.commit_rules(), "joint_threshold"]
    assert "edit_threshold" not in block.diffusion_fields()
    assert {"edit_threshold", "max_post_edit_steps", "entropy_bound"} <= set(
        editing.diffusion_fields()
    )
    assert ModelDecoding("self_speculation").commit_rules() == []


def test_the_servers_default_rule_fills_requests_that_choose_none() -> None:
    s_mode = ModelDecoding(
        "block_diffusion", 4, token_editing=True,
        default_rule=(("confidence_threshold", 0.5), ("edit_threshold", 0.0)),
    )  # fmt: skip
    plain = parse_chat_request(body(max_tokens=16), JSON, model=s_mode).params
    assert (plain.mode, plain.mask_threshold, plain.edit_threshold) == ("joint_threshold", 0.5, 0.0)
    # The budget alone is not a rule: the preset still applies and keeps it.
    steps = parse_chat_request(body(max_tokens=16, max_post_edit_steps=3), JSON, model=s_mode)
    assert (steps.params.mode, steps.params.max_post_edit_steps) == ("joint_threshold", 3)
    # A request that chooses a rule keeps its own.
    own = parse_chat_request(body(max_tokens=16, confidence_threshold=0.9), JSON, model=s_mode)
    assert (own.params.mode, own.params.edit_threshold) == ("threshold", None)
    eb = parse_chat_request(body(max_tokens=16, entropy_bound=1.0), JSON, model=s_mode)
    assert eb.params.mode == "entropy_bound"
