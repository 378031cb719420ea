"""From a raw request body to what the engine runs: the validated spec and the prompt ids.

One pipeline for the HTTP routes and the offline :class:`~dllm_serve.llm.LLM`'s ``chat`` and
``complete``, so both apply the same rules, defaults and canvas fitting. Synchronous and free
of the web framework: the routes run it in a worker thread (validating megabytes of messages
or tokenizing a long prompt takes seconds, which on the event loop would stall every other
connection). Every refusal is an :class:`~dllm_serve.api.errors.APIError`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dllm_serve.api.error_handlers import unavailable
from dllm_serve.api.errors import invalid
from dllm_serve.api.mode_rules import ModelDecoding
from dllm_serve.api.prompt_checks import check_context_length, check_no_mask_token, check_token_ids
from dllm_serve.api.request_spec import RequestSpec
from dllm_serve.api.validation import parse_chat_request, parse_completion_request
from dllm_serve.engine.engine import AsyncEngine
from dllm_serve.engine.kv_budget import KVCapacityError
from dllm_serve.models.errors import ChatTemplateError


class ModelFacts:
    """What the request rules read from the served model: its blocks, vocabulary, mask id and
    decoding (read once from the engine)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        loaded = engine.loaded
        self.default_block_length: int | None = loaded.default_block_length
        self.vocab_size: int = loaded.vocab_size
        self.mask_id: int | None = loaded.mask_id
        self.block_size: int | None = loaded.block_size
        # The decoding_mode of requests that name none (tri-mode models: --decoding-mode).
        self.default_mode: str | None = engine.default_decoding_mode
        self.decoding = ModelDecoding(engine.decoding_mode, self.block_size, self.default_mode)
        # Canvas denoising drops canvas positions past max_tokens, so a long canvas may be
        # rounded up to whole blocks (api/request_params.py); no other decoding has a canvas.
        self.round_canvas = self.decoding.kind == "diffusion"

    def parse(
        self,
        parser: Callable[..., RequestSpec],
        raw: bytes,
        content_type: str | None,
        **extra: Any,
    ) -> RequestSpec:
        """``parser`` (``api/validation.py``) on a body, with this model's defaults and
        decoding rules; then its stop token ids are checked, and that the engine runs."""
        spec = parser(
            raw,
            content_type,
            **extra,
            default_gen_length=self.engine.default_gen_length,
            default_block_length=self.default_block_length,
            round_canvas=self.round_canvas,
            model=self.decoding,
        )
        if spec.params.stop_token_ids:
            check_token_ids(
                spec.params.stop_token_ids, self.vocab_size, self.mask_id, "stop_token_ids"
            )
        if not self.engine.is_alive:
            raise unavailable()
        return spec


def chat_request(
    facts: ModelFacts, raw: bytes, content_type: str | None, trace: bool = False
) -> tuple[RequestSpec, list[int]]:
    """A chat completion body's spec and templated prompt ids (``trace``: the trace
    endpoint's body, which refuses the streaming fields it has no use for)."""
    engine = facts.engine
    spec = facts.parse(parse_chat_request, raw, content_type, trace=trace)
    assert spec.messages is not None
    try:
        prompt_ids = engine.chat_prompt_ids(spec.messages)
    except ChatTemplateError as exc:
        raise invalid(f"{exc}.", "messages") from None
    check_no_mask_token(prompt_ids, facts.mask_id, "messages")
    return _fitted(spec, prompt_ids, engine, "messages")


def completion_request(
    facts: ModelFacts, raw: bytes, content_type: str | None
) -> tuple[RequestSpec, list[int]]:
    """A text completion body's spec and prompt ids (a string tokenized as is, or ids)."""
    engine = facts.engine
    spec = facts.parse(parse_completion_request, raw, content_type)
    if isinstance(spec.prompt, str):
        prompt_ids = engine.prompt_ids(spec.prompt)
        check_no_mask_token(prompt_ids, facts.mask_id, spec.prompt_param)
    else:
        assert spec.prompt is not None
        check_token_ids(spec.prompt, facts.vocab_size, facts.mask_id, spec.prompt_param)
        prompt_ids = spec.prompt
    if not prompt_ids:
        where = spec.prompt_param
        raise invalid(f"'{where}' is empty: it must hold at least one token.", where)
    return _fitted(spec, prompt_ids, engine, "prompt")


def _fitted(
    spec: RequestSpec, prompt_ids: list[int], engine: AsyncEngine, prompt_param: str
) -> tuple[RequestSpec, list[int]]:
    """The spec fitted to the prompt's length (``RequestSpec.fitted``), which must then leave
    room for the canvas in the model's context, and whose K/V must fit the whole KV pool."""
    spec = spec.fitted(len(prompt_ids), engine.max_length)
    check_context_length(
        len(prompt_ids), spec.params.gen_length, engine.max_length, prompt_param, spec.canvas_param
    )
    try:
        engine.kv.check(len(prompt_ids), spec.params)
    except KVCapacityError as exc:
        # Like a prompt past the context: retrying cannot help, so a 400 the client can act
        # on, not a 5xx that SDKs retry.
        raise invalid(
            f"This server cannot run the request: {exc}. Please reduce the length of the "
            f"prompt or the completion (the server's operator can raise --kv-cache-memory).",
            spec.canvas_param,
            code="context_length_exceeded",
        ) from None
    return spec, prompt_ids
