"""Turn a raw request body into a validated generation request.

The rules are docs/api-contract.md.

Everything here raises :class:`APIError` (HTTP 400, OpenAI envelope, ``param`` set) and never
anything else, so a malformed request can never become a 500. The table of accepted and
rejected requests in ``tests/unit/api/test_validation_table.py`` pins this behaviour.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from pydantic import ValidationError

from dllm_serve.api.errors import CONTRACT_REF, APIError, invalid
from dllm_serve.api.field_rules import (
    DIFFUSION_ONLY,
    check_commit_rule,
    reject_autoregressive_fields,
    reject_noop_fields,
    reject_unavailable_fields,
)
from dllm_serve.api.messages import messages_of
from dllm_serve.api.mode_rules import CANVAS, ModelDecoding, check_decoding_mode
from dllm_serve.api.protocol import ChatCompletionRequest, CompletionRequest
from dllm_serve.api.request_params import decoding_params, round_up_to_blocks
from dllm_serve.api.request_spec import RequestSpec
from dllm_serve.decoding.params import DEFAULT_GEN_LENGTH

GenerationRequest = ChatCompletionRequest | CompletionRequest
_R = TypeVar("_R", ChatCompletionRequest, CompletionRequest)
# Informational fields: logged with --log-requests, otherwise without effect.
INFORMATIONAL = (
    "user",
    "metadata",
    "prompt_cache_key",
    "safety_identifier",
    "parallel_tool_calls",
    "service_tier",
)


def parse_chat_request(
    raw: bytes,
    content_type: str | None,
    default_gen_length: int = DEFAULT_GEN_LENGTH,
    default_block_length: int | None = None,
    round_canvas: bool = False,
    model: ModelDecoding | None = None,
    trace: bool = False,
) -> RequestSpec:
    """Validate a chat request body (docs/api-contract.md); ``default_gen_length`` is the
    model's canvas for requests that set no ``max_tokens``, ``default_block_length`` its
    recommended block for long canvases that set no ``block_length`` (None: one block),
    ``round_canvas`` whether such a canvas may be rounded up to whole blocks
    (``request_params.decoding_params``), and ``model`` what the served model's decoding
    accepts (the mode rules of ``api/mode_rules.py`` run first; None: canvas denoising, with
    no mode check). ``trace``: the body of the trace endpoint, which refuses the streaming
    fields it has no use for first (it always streams, in its own events)."""
    req = _load(ChatCompletionRequest, raw, content_type)
    if trace:
        _check_trace_fields(req)
    messages = messages_of(req)
    return _spec(
        req, default_gen_length, default_block_length, round_canvas, model, messages=messages
    )


def _check_trace_fields(req: ChatCompletionRequest) -> None:
    if req.stream is False:
        raise invalid("The trace endpoint always streams; omit 'stream'.", "stream")
    if req.stream_options is not None:
        raise invalid(
            "'stream_options' is not supported by the trace endpoint: its done event always "
            "carries the usage.",
            "stream_options",
        )
    if req.include_stop_str_in_output:
        raise invalid(
            "'include_stop_str_in_output' is not supported by the trace endpoint.",
            "include_stop_str_in_output",
        )


def parse_completion_request(
    raw: bytes,
    content_type: str | None,
    default_gen_length: int = DEFAULT_GEN_LENGTH,
    default_block_length: int | None = None,
    round_canvas: bool = False,
    model: ModelDecoding | None = None,
) -> RequestSpec:
    """Validate a /v1/completions body: the same rules, with a raw ``prompt``."""
    req = _load(CompletionRequest, raw, content_type)
    prompt, prompt_param = _prompt(req.prompt)
    if req.suffix:
        raise invalid(
            "'suffix' (infilling) is not available yet in this server version: the canvas is "
            "appended after the prompt only.",
            "suffix",
            code="not_available_yet",
        )
    if req.logprobs is not None:
        raise invalid(
            "'logprobs' is not supported by diffusion decoding: log probabilities are "
            f"deferred. Omit it; {CONTRACT_REF}.",
            "logprobs",
            code="unsupported_parameter",
        )
    spec = _spec(req, default_gen_length, default_block_length, round_canvas, model, prompt=prompt)
    return dataclasses.replace(spec, prompt_param=prompt_param)


def _load(model: type[_R], raw: bytes, content_type: str | None) -> _R:
    _check_content_type(content_type)
    try:
        return model.model_validate_json(raw, strict=True)
    except ValidationError as exc:
        raise _from_pydantic(exc) from None


def _spec(
    req: GenerationRequest,
    default_gen_length: int,
    default_block_length: int | None,
    round_canvas: bool,
    model: ModelDecoding | None,
    *,
    messages: list[dict[str, str]] | None = None,
    prompt: str | list[int] | None = None,
) -> RequestSpec:
    reject_autoregressive_fields(req)
    reject_noop_fields(req)
    reject_unavailable_fields(req)
    stream = bool(req.stream)
    options = req.stream_options
    if options is not None and not stream:
        raise invalid("'stream_options' is only allowed when 'stream' is true.", "stream_options")
    if options is not None and options.include_obfuscation:
        raise invalid(
            "'stream_options.include_obfuscation' is not supported.",
            "stream_options.include_obfuscation",
            code="not_available_yet",
        )
    diffusion_fields = tuple(f for f in DIFFUSION_ONLY if getattr(req, f) is not None)
    info = {name: getattr(req, name, None) for name in INFORMATIONAL}
    rules = CANVAS
    if model is not None:
        # The mode rules first: a field that does not apply to this model is refused as such,
        # before any canvas arithmetic (which would not apply either).
        check_decoding_mode(req.decoding_mode, req.block_length, diffusion_fields, model)
        rules = model.canvas_rules(req.decoding_mode)
    # After the mode rules (found by QA: a local_leap_* field on I-DLM was told to set
    # use_local_leap, which the mode rules then refused as not_applicable).
    check_commit_rule(req)
    block_size = model.block_size if model is not None else None
    refused = None  # a step count the rounded canvas refuses, decided once the prompt is known
    try:
        params = decoding_params(
            req, default_gen_length, default_block_length, round_canvas, rules, block_size
        )
    except APIError as exc:
        if not (round_canvas and exc.param == "num_denoising_steps" and default_block_length):
            raise
        # The rounded canvas's blocks do not divide the client's steps; one unrounded block
        # (which any step count fits) is what a prompt that leaves no room for the rounding
        # gets, so refuse only if the rounded canvas turns out to fit (RequestSpec.fitted).
        params = decoding_params(req, default_gen_length, default_block_length)
        refused = (exc, round_up_to_blocks(params.gen_length, default_block_length))
    unrounded = None
    if params.answer_limit is not None:
        unrounded = decoding_params(req, default_gen_length, default_block_length)
    return RequestSpec(
        messages,
        params,
        stream,
        bool(options and options.include_usage),
        _stop(req),
        diffusion_fields,
        prompt=prompt,
        continuous_usage=bool(options and options.continuous_usage_stats),
        include_stop_str=bool(req.include_stop_str_in_output),
        info={k: v for k, v in info.items() if v is not None},
        unrounded=unrounded,
        canvas_param=_canvas_param(req),
        refused_if_rounded=refused,
    )


def _canvas_param(req: GenerationRequest) -> str:
    if req.target_length is not None:
        return "target_length"
    if getattr(req, "max_completion_tokens", None):
        return "max_completion_tokens"
    return "max_tokens"


def _prompt(prompt: Any) -> tuple[str | list[int], str]:
    """A string or token ids, and where they sit in the body; a list holding one of them is
    accepted (one prompt per request)."""
    unwrapped = isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list)
    if unwrapped:
        prompt = prompt[0]
    param = "prompt[0]" if unwrapped else "prompt"
    if isinstance(prompt, str):
        return prompt, param
    batched = isinstance(prompt, list) and prompt and all(isinstance(t, str | list) for t in prompt)
    if batched and not unwrapped:  # a nested list inside the one prompt is just invalid
        raise invalid(
            f"'prompt' holds {len(prompt)} prompts; one prompt per request is supported "
            "(batched prompts are deferred, like n > 1).",
            "prompt",
            code="unsupported_parameter",
        )
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return list(prompt), param
    raise invalid(
        "Invalid value for 'prompt': a string or a non-empty list of token ids.", "prompt"
    )


MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256


def _stop(req: GenerationRequest) -> tuple[str, ...]:
    """OpenAI's ``stop``: a string or up to 4 strings; the answer ends before the first one."""
    if req.stop is None:
        return ()
    if not isinstance(req.stop, str | list):
        raise invalid("Invalid value for 'stop': a string or a list of strings.", "stop")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid(f"'stop' accepts at most {MAX_STOP_STRINGS} strings.", "stop")
    for i, text in enumerate(stops):
        param = "stop" if isinstance(req.stop, str) else f"stop[{i}]"
        if not isinstance(text, str):
            raise invalid(f"Invalid value for '{param}': stop strings must be strings.", param)
        if not text:
            raise invalid("Stop strings must not be empty.", param)
        if len(text) > MAX_STOP_CHARS:
            raise invalid(f"Stop strings are limited to {MAX_STOP_CHARS} characters.", param)
    return tuple(stops)


def _check_content_type(content_type: str | None) -> None:
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != "application/json" and not (
        media.startswith("application/") and media.endswith("+json")
    ):
        shown = f"Unsupported Content-Type '{content_type}'" if content_type else "No Content-Type"
        raise invalid(
            f"{shown}: the request body must be JSON sent with 'Content-Type: application/json'.",
            code="unsupported_media_type",
        )


def _param_path(loc: tuple[Any, ...]) -> str | None:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or None


def _from_pydantic(exc: ValidationError) -> APIError:
    err = exc.errors(include_url=False)[0]
    kind, param, msg = err["type"], _param_path(tuple(err["loc"])), err["msg"]
    if kind == "json_invalid":
        detail = err.get("ctx", {}).get("error", msg)
        return invalid(f"We could not parse the JSON body of your request: {detail}.")
    if kind == "model_type" and param is None:
        return invalid("The request body must be a JSON object.")
    if kind == "extra_forbidden":
        return invalid(f"Unrecognized request argument supplied: {param}", param)
    if kind == "missing":
        return invalid(f"Missing required parameter: '{param}'.", param)
    return invalid(f"Invalid value for '{param}': {msg}.", param)
