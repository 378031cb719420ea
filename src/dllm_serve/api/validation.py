"""Turn a raw request body into a validated generation request (ADR 005).

Everything here raises :class:`APIError` (HTTP 400, OpenAI envelope, ``param`` set) and never
anything else, so a malformed request can never become a 500. The table of accepted and
rejected requests in ``tests/unit/api/test_validation_table.py`` pins this behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from dllm_serve.api.errors import APIError, invalid
from dllm_serve.api.field_rules import (
    DIFFUSION_ONLY,
    check_commit_rule,
    local_leap_settings,
    reject_autoregressive_fields,
    reject_unavailable_fields,
)
from dllm_serve.api.protocol import ChatCompletionRequest
from dllm_serve.decoding.params import DEFAULT_GEN_LENGTH, DEFAULT_STEPS, DecodingParams

MAX_STEPS = 512


@dataclass(frozen=True, slots=True)
class ChatRequestSpec:
    """A validated chat request: what the route hands to the engine."""

    messages: list[dict[str, str]]
    params: DecodingParams
    stream: bool
    include_usage: bool
    stop: tuple[str, ...] = ()
    diffusion_fields: tuple[str, ...] = ()  # canvas-denoising fields the client set

    def check_decoding_mode(self, mode: str) -> None:
        """Self-speculative (I-DLM) models have no canvas to denoise: those fields are 400s."""
        if mode == "self_speculation" and self.diffusion_fields:
            name = self.diffusion_fields[0]
            raise invalid(
                f"'{name}' configures diffusion denoising, but this model decodes by exact "
                "self-speculation (I-DLM): it has no denoising steps, blocks, schedules or commit "
                "thresholds. Omit it; max_tokens, temperature, seed and stop apply.",
                name,
                code="not_applicable",
            )


def parse_chat_request(
    raw: bytes, content_type: str | None, default_gen_length: int = DEFAULT_GEN_LENGTH
) -> ChatRequestSpec:
    """Validate a chat request body (ADR 005); ``default_gen_length`` is the model's canvas
    for requests that set no ``max_tokens``."""
    _check_content_type(content_type)
    try:
        req = ChatCompletionRequest.model_validate_json(raw, strict=True)
    except ValidationError as exc:
        raise _from_pydantic(exc) from None
    messages = _messages(req)
    reject_autoregressive_fields(req)
    reject_unavailable_fields(req)
    check_commit_rule(req)
    stream = bool(req.stream)
    if req.stream_options is not None and not stream:
        raise invalid("'stream_options' is only allowed when 'stream' is true.", "stream_options")
    if req.stream_options is not None and req.stream_options.include_obfuscation:
        raise invalid(
            "'stream_options.include_obfuscation' is not supported.",
            "stream_options.include_obfuscation",
        )
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    diffusion_fields = tuple(f for f in DIFFUSION_ONLY if getattr(req, f) is not None)
    return ChatRequestSpec(
        messages,
        _decoding_params(req, default_gen_length),
        stream,
        include_usage,
        _stop(req),
        diffusion_fields,
    )


MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256


def _stop(req: ChatCompletionRequest) -> tuple[str, ...]:
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


def check_context_length(prompt_tokens: int, gen_length: int, max_length: int) -> None:
    """The prompt plus the canvas must fit the model's context."""
    if prompt_tokens + gen_length > max_length:
        param = "messages" if prompt_tokens >= max_length else "max_tokens"
        raise invalid(
            f"This model's maximum context length is {max_length} tokens. However, you "
            f"requested {prompt_tokens + gen_length} tokens ({prompt_tokens} in the messages, "
            f"{gen_length} in the completion canvas). Please reduce the length of the messages "
            "or the completion.",
            param,
            code="context_length_exceeded",
        )


def _check_content_type(content_type: str | None) -> None:
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != "application/json" and not (
        media.startswith("application/") and media.endswith("+json")
    ):
        shown = content_type or "none"
        raise invalid(
            f"Unsupported Content-Type '{shown}': the request body must be JSON sent with "
            "'Content-Type: application/json'.",
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


def _messages(req: ChatCompletionRequest) -> list[dict[str, str]]:
    if not req.messages:
        raise invalid("'messages' must contain at least one message.", "messages")
    out = []
    for i, m in enumerate(req.messages):
        out.append({"role": m.role, "content": _content_text(m.content, f"messages[{i}].content")})
    return out


def _content_text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise invalid(
                    f"Invalid content part at '{param}[{j}]': only text parts "
                    '({"type": "text", "text": "..."}) are supported.',
                    f"{param}[{j}]",
                )
            if set(part) != {"type", "text"} or not isinstance(part["text"], str):
                raise invalid(
                    f"Invalid content part at '{param}[{j}]': a text part has exactly the "
                    "keys 'type' and 'text', and 'text' is a string.",
                    f"{param}[{j}]",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(
        f"Invalid value for '{param}': content must be a string or a list of text parts.", param
    )


def _decoding_params(req: ChatCompletionRequest, default_gen_length: int) -> DecodingParams:
    max_tokens = req.max_completion_tokens or req.max_tokens
    if req.max_tokens and req.max_completion_tokens and req.max_tokens != req.max_completion_tokens:
        raise invalid(
            "'max_tokens' and 'max_completion_tokens' are the same setting and were given "
            "different values.",
            "max_completion_tokens",
        )
    if req.target_length is not None and max_tokens is not None and max_tokens < req.target_length:
        raise invalid(
            f"'target_length' ({req.target_length}) sets the canvas length and exceeds "
            f"max_tokens ({max_tokens}).",
            "target_length",
        )
    gen_length = req.target_length or max_tokens or default_gen_length
    block_length = req.block_length or gen_length
    if block_length > gen_length or gen_length % block_length:
        raise invalid(
            f"'block_length' ({block_length}) must divide the canvas length ({gen_length}).",
            "block_length",
        )
    num_blocks = gen_length // block_length
    if num_blocks > MAX_STEPS:
        raise invalid(
            f"The canvas of {gen_length} tokens has {num_blocks} blocks of {block_length}; at "
            f"most {MAX_STEPS} blocks are allowed (each block needs a denoising step).",
            "block_length",
        )
    if req.num_denoising_steps is None:
        # ADR default 128 capped at the canvas, rounded down to a multiple of the block count.
        steps = max(num_blocks, min(DEFAULT_STEPS, gen_length) // num_blocks * num_blocks)
    else:
        steps = req.num_denoising_steps
        if steps % num_blocks:
            raise invalid(
                f"'num_denoising_steps' ({steps}) must be a multiple of the number of blocks "
                f"({num_blocks} = canvas {gen_length} / block_length {block_length}).",
                "num_denoising_steps",
            )
    temperature = 0.0 if req.temperature is None else req.temperature
    if req.top_k == 1:
        temperature = 0.0  # top_k=1 asks for the most likely token: greedy decoding
    try:
        return _build_params(req, gen_length, steps, block_length, temperature)
    except ValueError as exc:  # a combination the checks above missed: still a 400, never a 500
        raise invalid(f"Invalid decoding parameters: {exc}.") from None


def _build_params(
    req: ChatCompletionRequest, gen_length: int, steps: int, block_length: int, temperature: float
) -> DecodingParams:
    return DecodingParams(
        gen_length=gen_length,
        steps=steps,
        block_length=block_length,
        temperature=temperature,
        seed=req.seed,
        block_schedule=req.block_schedule or "uniform",
        confidence_metric=req.confidence_metric or "top1_prob",
        force_single_batch=bool(req.force_single_batch),
        confidence_threshold=req.confidence_threshold,
        use_local_leap=bool(req.use_local_leap),
        **local_leap_settings(req),
    )
