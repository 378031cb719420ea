"""Turn a raw request body into a validated generation request.

The rules are docs/api-contract.md.

Everything here raises :class:`APIError` (HTTP 400, OpenAI envelope, ``param`` set) and never
anything else, so a malformed request can never become a 500. The table of accepted and
rejected requests in ``tests/unit/api/test_validation_table.py`` pins this behaviour.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import ValidationError

from dllm_serve.api.errors import APIError, invalid
from dllm_serve.api.field_rules import (
    DIFFUSION_ONLY,
    check_commit_rule,
    local_leap_settings,
    reject_autoregressive_fields,
    reject_noop_fields,
    reject_unavailable_fields,
)
from dllm_serve.api.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from dllm_serve.decoding.params import DEFAULT_GEN_LENGTH, DEFAULT_STEPS, DecodingParams

MAX_STEPS = 512
GenerationRequest = ChatCompletionRequest | CompletionRequest
_R = TypeVar("_R", ChatCompletionRequest, CompletionRequest)
# Informational fields: logged with --log-requests, otherwise without effect.
INFORMATIONAL = ("user", "metadata", "prompt_cache_key", "safety_identifier", "service_tier")


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """A validated chat or text-completion request: what the route hands to the engine.

    Chat requests carry ``messages`` (rendered with the chat template); text completions carry
    ``prompt`` (a string tokenized as is, or token ids).
    """

    messages: list[dict[str, str]] | None
    params: DecodingParams
    stream: bool
    include_usage: bool
    stop: tuple[str, ...] = ()
    diffusion_fields: tuple[str, ...] = ()  # canvas-denoising fields the client set
    prompt: str | list[int] | None = None
    continuous_usage: bool = False  # stream_options.continuous_usage_stats
    include_stop_str: bool = False  # include_stop_str_in_output
    info: dict[str, Any] = field(default_factory=dict)  # informational fields the client set

    def check_decoding_mode(self, mode: str, block_size: int | None = None) -> None:
        """Self-speculative (I-DLM) models have no canvas to denoise: those fields are 400s.
        Block-diffusion models (SDAR) decode in their trained block: another block_length is
        a 400."""
        if (
            mode == "block_diffusion"
            and "block_length" in self.diffusion_fields
            and self.params.block_length != block_size
        ):
            raise invalid(
                f"'block_length' must be {block_size} for this model: it is a block-diffusion "
                "model trained with that block (bidirectional inside a block, causal across "
                "blocks), and other blocks are not what it learned. Omit it.",
                "block_length",
                code="not_applicable",
            )
        if mode == "self_speculation" and self.diffusion_fields:
            name = self.diffusion_fields[0]
            raise invalid(
                f"'{name}' configures diffusion denoising, but this model decodes by exact "
                "self-speculation (I-DLM): it has no denoising steps, blocks, schedules or commit "
                "thresholds. Omit it; max_tokens, temperature, seed and stop apply.",
                name,
                code="not_applicable",
            )


ChatRequestSpec = RequestSpec  # the name the chat route has always used


def parse_chat_request(
    raw: bytes,
    content_type: str | None,
    default_gen_length: int = DEFAULT_GEN_LENGTH,
    default_block_length: int | None = None,
) -> RequestSpec:
    """Validate a chat request body (docs/api-contract.md); ``default_gen_length`` is the
    model's canvas for requests that set no ``max_tokens``, ``default_block_length`` its
    recommended block for long canvases that set no ``block_length`` (None: one block)."""
    req = _load(ChatCompletionRequest, raw, content_type)
    messages = _messages(req)
    return _spec(req, default_gen_length, default_block_length, messages=messages)


def parse_completion_request(
    raw: bytes,
    content_type: str | None,
    default_gen_length: int = DEFAULT_GEN_LENGTH,
    default_block_length: int | None = None,
) -> RequestSpec:
    """Validate a /v1/completions body: the same rules, with a raw ``prompt``."""
    req = _load(CompletionRequest, raw, content_type)
    prompt = _prompt(req.prompt)
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
            "deferred. Omit it.",
            "logprobs",
            code="unsupported_parameter",
        )
    return _spec(req, default_gen_length, default_block_length, prompt=prompt)


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
    *,
    messages: list[dict[str, str]] | None = None,
    prompt: str | list[int] | None = None,
) -> RequestSpec:
    reject_autoregressive_fields(req)
    reject_noop_fields(req)
    reject_unavailable_fields(req)
    check_commit_rule(req)
    stream = bool(req.stream)
    options = req.stream_options
    if options is not None and not stream:
        raise invalid("'stream_options' is only allowed when 'stream' is true.", "stream_options")
    if options is not None and options.include_obfuscation:
        raise invalid(
            "'stream_options.include_obfuscation' is not supported.",
            "stream_options.include_obfuscation",
        )
    diffusion_fields = tuple(f for f in DIFFUSION_ONLY if getattr(req, f) is not None)
    info = {name: getattr(req, name, None) for name in INFORMATIONAL}
    return RequestSpec(
        messages,
        _decoding_params(req, default_gen_length, default_block_length),
        stream,
        bool(options and options.include_usage),
        _stop(req),
        diffusion_fields,
        prompt=prompt,
        continuous_usage=bool(options and options.continuous_usage_stats),
        include_stop_str=bool(req.include_stop_str_in_output),
        info={k: v for k, v in info.items() if v is not None},
    )


def _prompt(prompt: Any) -> str | list[int]:
    """A string or token ids; a list holding one of them is accepted (one prompt per request)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, str | list) for t in prompt):
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
        return list(prompt)
    raise invalid(
        "Invalid value for 'prompt': a string or a non-empty list of token ids.", "prompt"
    )


def check_token_ids(ids: Sequence[int], vocab_size: int, mask_id: int | None, param: str) -> None:
    """Token ids sent by the client must be in the vocabulary and never the mask token."""
    for i, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise invalid(
                f"Invalid value for '{param}[{i}]': token id {token} is outside the model's "
                f"vocabulary (0 to {vocab_size - 1}).",
                f"{param}[{i}]",
            )
        if token == mask_id:
            raise invalid(
                f"Invalid value for '{param}[{i}]': token id {token} is the model's mask token.",
                f"{param}[{i}]",
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


def check_context_length(
    prompt_tokens: int, gen_length: int, max_length: int, prompt_param: str = "messages"
) -> None:
    """The prompt plus the canvas must fit the model's context."""
    if prompt_tokens + gen_length > max_length:
        param = prompt_param if prompt_tokens >= max_length else "max_tokens"
        raise invalid(
            f"This model's maximum context length is {max_length} tokens. However, you "
            f"requested {prompt_tokens + gen_length} tokens ({prompt_tokens} in the "
            f"{prompt_param}, {gen_length} in the completion canvas). Please reduce the length "
            f"of the {prompt_param} or the completion.",
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
        _check_returned_fields(m, i)
        # "developer" is OpenAI's current name for the system role.
        role = "system" if m.role == "developer" else m.role
        message = {"role": role, "content": _content_text(m.content, f"messages[{i}].content")}
        if m.name is not None:
            message["name"] = m.name  # chat templates that have a slot for it use it
        out.append(message)
    return out


def _check_returned_fields(m: ChatMessage, i: int) -> None:
    """Fields of the assistant message this server returns: only their empty values."""
    for name in ("tool_calls", "function_call"):
        value = getattr(m, name)
        if value is not None and not (name == "tool_calls" and value == []):
            raise invalid(
                f"'messages[{i}].{name}' is not supported by diffusion decoding: function "
                f"calling is out of scope. Only null{' or []' if name == 'tool_calls' else ''} "
                "is accepted.",
                f"messages[{i}].{name}",
                code="unsupported_parameter",
            )
    for name, empty in (("refusal", "null"), ("audio", "null"), ("annotations", "null or []")):
        value = getattr(m, name)
        if value is not None and not (name == "annotations" and value == []):
            raise invalid(
                f"'messages[{i}].{name}' must be {empty}: this server never returns one.",
                f"messages[{i}].{name}",
            )


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


def _decoding_params(
    req: GenerationRequest, default_gen_length: int, default_block_length: int | None
) -> DecodingParams:
    max_completion_tokens = getattr(req, "max_completion_tokens", None)
    max_tokens = max_completion_tokens or req.max_tokens
    if req.max_tokens and max_completion_tokens and req.max_tokens != max_completion_tokens:
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
    auto_block = None
    if req.block_length is None and default_block_length:
        auto_block = recommended_block(gen_length, default_block_length)
    block_length = req.block_length or auto_block or gen_length
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
    if req.num_denoising_steps is None and auto_block is not None:
        # The server chose the blocks: each gets the steps a one-block canvas of that size
        # would get (one token per step for the demo models), so quality does not depend on
        # how long a canvas the client asked for.
        steps = num_blocks * min(DEFAULT_STEPS, block_length)
    elif req.num_denoising_steps is None:
        # Default 128 capped at the canvas, rounded down to a multiple of the block count.
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


def recommended_block(gen_length: int, block: int) -> int | None:
    """The block a long canvas is decoded in when the request names none.

    A canvas longer than the model's recommended block is split into blocks of about that
    size, so an answer that ends with EOS early ends the work one block later: the largest
    divisor of the canvas between half the block and the block. None (one block, the
    contract's default) when the canvas fits in one block or has no such divisor.
    """
    if gen_length <= block:
        return None
    for size in range(block, (block + 1) // 2 - 1, -1):
        if size >= 1 and gen_length % size == 0 and gen_length // size <= MAX_STEPS:
            return size
    return None


def _build_params(
    req: GenerationRequest, gen_length: int, steps: int, block_length: int, temperature: float
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
        ignore_eos=bool(req.ignore_eos),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        **local_leap_settings(req),
    )
