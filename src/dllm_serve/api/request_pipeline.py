"""From a raw request body to what the engine runs: the validated spec and the prompt ids.

One pipeline for the HTTP routes and the offline :class:`~dllm_serve.llm.LLM`'s ``chat`` and
``complete``, so both apply the same rules, defaults and canvas fitting. Synchronous and free
of the web framework: the routes run it in a worker thread (validating megabytes of messages
or tokenizing a long prompt takes seconds, which on the event loop would stall every other
connection). Every refusal is an :class:`~dllm_serve.api.errors.APIError`.
"""

from __future__ import annotations

from dllm_serve.api.error_handlers import unavailable
from dllm_serve.api.errors import invalid
from dllm_serve.api.mode_rules import ModelDecoding
from dllm_serve.api.prompt_checks import check_context_length, check_no_mask_token, check_token_ids
from dllm_serve.api.request_spec import RequestSpec
from dllm_serve.api.validation import parse_chat_request, parse_completion_request
from dllm_serve.engine.engine import AsyncEngine
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

    def check_stop_token_ids(self, spec: RequestSpec) -> None:
        if spec.params.stop_token_ids:
            check_token_ids(
                spec.params.stop_token_ids, self.vocab_size, self.mask_id, "stop_token_ids"
            )


def chat_request(
    facts: ModelFacts, raw: bytes, content_type: str | None, trace: bool = False
) -> tuple[RequestSpec, list[int]]:
    """A chat completion body's spec and templated prompt ids (``trace``: the trace
    endpoint's body, which refuses the streaming fields it has no use for)."""
    engine = facts.engine
    spec = parse_chat_request(
        raw,
        content_type,
        engine.default_gen_length,
        facts.default_block_length,
        facts.round_canvas,
        facts.decoding,
        trace,
    )
    facts.check_stop_token_ids(spec)
    if not engine.is_alive:
        raise unavailable()
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
    spec = parse_completion_request(
        raw,
        content_type,
        engine.default_gen_length,
        facts.default_block_length,
        facts.round_canvas,
        facts.decoding,
    )
    facts.check_stop_token_ids(spec)
    if not engine.is_alive:
        raise unavailable()
    if isinstance(spec.prompt, str):
        prompt_ids = engine.prompt_ids(spec.prompt)
        check_no_mask_token(prompt_ids, facts.mask_id, "prompt")
    else:
        assert spec.prompt is not None
        check_token_ids(spec.prompt, facts.vocab_size, facts.mask_id, "prompt")
        prompt_ids = spec.prompt
    if not prompt_ids:
        raise invalid("'prompt' is empty: it must hold at least one token.", "prompt")
    return _fitted(spec, prompt_ids, engine, "prompt")


def _fitted(
    spec: RequestSpec, prompt_ids: list[int], engine: AsyncEngine, prompt_param: str
) -> tuple[RequestSpec, list[int]]:
    """The spec fitted to the prompt's length (``RequestSpec.fitted``), which must then leave
    room for the canvas in the model's context."""
    spec = spec.fitted(len(prompt_ids), engine.max_length)
    check_context_length(
        len(prompt_ids), spec.params.gen_length, engine.max_length, prompt_param, spec.canvas_param
    )
    return spec, prompt_ids
