"""From a raw request body to what the engine runs: the validated spec and the prompt ids.

One pipeline for the HTTP routes and the offline :class:`~dllm_serve.llm.LLM`'s ``chat`` and
``complete``, so both apply the same rules (``rules.py``), defaults and canvas fitting:

    body bytes → the protocol model (pydantic) → field and mode rules → :class:`RequestSpec`
    → the prompt's token ids (chat template, or the raw prompt) → checks against the model
    (vocabulary, mask token, context length, KV pool) → the spec fitted to the prompt

Synchronous and free of the web framework: the routes run it in a worker thread (validating
megabytes of messages or tokenizing a long prompt takes seconds, which on the event loop would
stall every other connection). Every refusal is an :class:`~dllm_serve.api.errors.APIError`
(HTTP 400, OpenAI envelope, ``param`` set) and never anything else, so a malformed request can
never become a 500; ``tests/unit/api/test_validation_table.py`` pins the table of accepted and
rejected requests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from pydantic import ValidationError

from dllm_serve.api.errors import APIError, invalid, unavailable
from dllm_serve.api.messages import messages_of
from dllm_serve.api.parameters import decoding_params, round_up_to_blocks
from dllm_serve.api.protocol import ChatCompletionRequest, CompletionRequest
from dllm_serve.api.rules import (
    BLOCK,
    CANVAS,
    DIFFUSION_ONLY,
    ModelDecoding,
    Request,
    check_commit_rule,
    check_decoding_mode,
    check_editing,
    reject_autoregressive_fields,
    reject_noop_fields,
    reject_unavailable_fields,
)
from dllm_serve.api.tools import ToolSpec, parser_for, tool_spec
from dllm_serve.decoding.grammar import GrammarError
from dllm_serve.decoding.params import DEFAULT_GEN_LENGTH, DecodingParams
from dllm_serve.engine.engine import AsyncEngine
from dllm_serve.engine.scheduler import KVCapacityError
from dllm_serve.models.errors import ChatTemplateError

# ---- the validated request ---------------------------------------------------------------------


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
    # Where ``prompt`` sits in the body, for errors naming one of its tokens ("prompt[0]" when
    # the client wrapped it in a one-element list).
    prompt_param: str = "prompt"
    continuous_usage: bool = False  # stream_options.continuous_usage_stats
    include_stop_str: bool = False  # include_stop_str_in_output
    info: dict[str, Any] = field(default_factory=dict)  # informational fields the client set
    # When ``params`` rounded the canvas up to whole blocks: the same request unrounded (one
    # block of max_tokens), for a prompt that leaves room for max_tokens but not the rounding.
    unrounded: DecodingParams | None = None
    # The field that set the canvas, which a context-length error names.
    canvas_param: str = "max_tokens"
    # (error, rounded canvas length): the client's step count does not fit the rounded canvas's
    # blocks; ``fitted`` raises it when that canvas fits the context, else keeps one block.
    refused_if_rounded: tuple[APIError, int] | None = None
    n: int = 1  # choices: rows of the same prompt, each with its own generator
    tools: ToolSpec | None = None  # chat: the request's tools (api/tools.py)
    suffix: str | None = None  # /v1/completions infilling: the text after the canvas

    def choice_params(self) -> list[DecodingParams]:
        """Each choice's parameters: with a ``seed``, choice ``i`` draws from ``seed + i``
        (same seed ⇒ same n answers; at temperature 0 they are all the greedy answer)."""
        seed = self.params.seed
        if self.n == 1 or seed is None:
            return [self.params] * self.n
        return [replace(self.params, seed=seed + i) for i in range(self.n)]

    def fitted(self, prompt_tokens: int, max_length: int) -> RequestSpec:
        """This spec for a prompt of ``prompt_tokens``: a canvas rounded up to whole blocks
        that would overflow the context, while max_tokens itself fits, keeps the whole blocks
        that fit (the answer may then be up to a block shorter than max_tokens, never longer)
        or, when the client set the step count (which fewer blocks would change), falls back
        to one unrounded block. When max_tokens itself does not fit, the unrounded request is
        returned, so the context check refuses the client's own number."""
        if self.refused_if_rounded is not None:
            error, rounded = self.refused_if_rounded
            if prompt_tokens + rounded <= max_length:
                raise error
            return replace(self, refused_if_rounded=None)  # one unrounded block, any steps
        params, unrounded = self.params, self.unrounded
        if unrounded is None or prompt_tokens + params.gen_length <= max_length:
            return self
        block = params.block_length
        assert block is not None  # resolved by DecodingParams
        whole = (max_length - prompt_tokens) // block * block
        fits = prompt_tokens + unrounded.gen_length <= max_length
        if fits and whole >= block and "num_denoising_steps" not in self.diffusion_fields:
            steps = whole // block * params.steps_per_block
            shrunk = replace(params, gen_length=whole, steps=steps, answer_limit=None)
            return replace(self, params=shrunk, unrounded=None)
        return replace(self, params=unrounded, unrounded=None)


# ---- body → spec -------------------------------------------------------------------------------


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
    accepts (the mode rules of ``rules.py`` run first; None: canvas denoising, with
    no mode check). ``trace``: the body of the trace endpoint, which refuses the streaming
    fields it has no use for first (it always streams, in its own events)."""
    req = _load(ChatCompletionRequest, raw, content_type)
    if trace:
        _check_trace_fields(req)
    messages = messages_of(req)
    tools = tool_spec(req.tools, req.tool_choice, req.parallel_tool_calls)
    if trace and tools is not None:
        raise invalid("The trace endpoint traces text answers: omit 'tools'.", "tools")
    if tools is not None and tools.forced:
        # The call is decoded under the structured-output grammar of its schema.
        if req.response_format not in (None, {"type": "text"}):
            raise invalid(
                "'response_format' and a forced tool call ('tool_choice' 'required' or a named "
                "function) both constrain the answer; send one of them.",
                "response_format",
            )
        req = req.model_copy(update={"response_format": tools.response_format()})
    spec = _spec(
        req, default_gen_length, default_block_length, round_canvas, model, messages=messages
    )
    return spec if tools is None else dataclasses.replace(spec, tools=tools)


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
    if req.n not in (None, 1):
        raise invalid("The trace endpoint traces one answer: 'n' must be 1.", "n")


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
    if req.suffix and model is not None and not model.infilling:
        raise invalid(
            "'suffix' (infilling) needs a model whose canvas attends to the text after it "
            "(LLaDA, Dream: bidirectional canvas denoising). This model reads left to right "
            "(causal, or block-causal across blocks), so its answer could not depend on a "
            "suffix. Omit it.",
            "suffix",
            code="not_applicable",
        )
    spec = _spec(req, default_gen_length, default_block_length, round_canvas, model, prompt=prompt)
    if req.suffix:
        # The canvas must end where the suffix begins: never rounded up to whole blocks with
        # the answer cut short (that would leave dropped positions between them).
        params = spec.unrounded or spec.params
        spec = dataclasses.replace(spec, params=params, unrounded=None, refused_if_rounded=None)
    return dataclasses.replace(spec, prompt_param=prompt_param, suffix=req.suffix or None)


def _load(model: type[_R], raw: bytes, content_type: str | None) -> _R:
    _check_content_type(content_type)
    try:
        return model.model_validate_json(raw, strict=True)
    except ValidationError as exc:
        raise _from_pydantic(exc) from None


def _spec(
    req: Request,
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
        if rules in (CANVAS, BLOCK):
            req = model.with_default_rule(req)
        check_editing(req, model)
        model.check_logprobs(req)
        model.check_response_format(req)
    # After the mode rules: a local_leap_* field on a model without diffusion decoding is
    # not_applicable, not a hint to set use_local_leap.
    check_commit_rule(req)
    block_size = model.block_size if model is not None else None
    refused = None  # a step count the rounded canvas refuses, decided once the prompt is known
    try:
        params = decoding_params(
            req, default_gen_length, default_block_length, round_canvas, rules, block_size, model
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
        n=req.n or 1,
    )


def _canvas_param(req: Request) -> str:
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
            "(batched prompts are deferred; n gives several choices of one prompt).",
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


def _stop(req: Request) -> tuple[str, ...]:
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


# ---- checks against the model ------------------------------------------------------------------


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


def check_no_mask_token(ids: Sequence[int], mask_id: int | None, param: str) -> None:
    """A prompt written as text must not tokenize to the mask token either.

    The mask token marks a position for the model to fill in. The server fills the answer
    canvas only, so a mask in the prompt would stay a hole the model reads as noise, where the
    reference loop would fill it; the same token given as an id is refused
    (:func:`check_token_ids`), and so is its text.
    """
    if mask_id is not None and mask_id in ids:
        raise invalid(
            f"Invalid value for '{param}': the text contains the model's mask token (id "
            f"{mask_id}), which marks a position to fill in; only the answer canvas is "
            "filled in, so a prompt may not contain it.",
            param,
        )


def check_context_length(
    prompt_tokens: int,
    gen_length: int,
    max_length: int,
    prompt_param: str = "messages",
    canvas_param: str = "max_tokens",
) -> None:
    """The prompt plus the canvas must fit the model's context; ``canvas_param`` is the field
    that set the canvas (``RequestSpec.canvas_param``)."""
    if prompt_tokens + gen_length > max_length:
        param = prompt_param if prompt_tokens >= max_length else canvas_param
        raise invalid(
            f"This model's maximum context length is {max_length} tokens. However, you "
            f"requested {prompt_tokens + gen_length} tokens ({prompt_tokens} in the "
            f"{prompt_param}, {gen_length} in the completion canvas). Please reduce the length "
            f"of the {prompt_param} or the completion.",
            param,
            code="context_length_exceeded",
        )


# ---- spec → prompt ids -------------------------------------------------------------------------


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
        # DiffusionGemma's renoise sampler: its canvas and the checkpoint's step limit.
        settings = getattr(engine.algorithm, "settings", None)
        self.decoding = ModelDecoding(
            engine.decoding_mode,
            self.block_size,
            self.default_mode,
            token_editing=engine.token_editing,
            insert_delete=engine.insert_delete,
            infilling=engine.infilling,
            default_rule=tuple(engine.default_commit_rule.items()),
            logprob_modes=engine.logprob_modes,
            structured_refusals=tuple(engine.structured_refusals.items()),
            canvas_length=getattr(engine.algorithm, "canvas_length", None),
            max_denoising_steps=getattr(settings, "max_denoising_steps", None),
        )
        # Canvas denoising drops canvas positions past max_tokens, so a long canvas may be
        # rounded up to whole blocks (rules.py); no other decoding has a canvas.
        self.round_canvas = self.decoding.kind == "diffusion"
        # The hermes tool-call markers where the vocabulary has them as single tokens.
        vocab = loaded.tokenizer.get_vocab()
        opening, closing = vocab.get("<tool_call>"), vocab.get("</tool_call>")
        self.tool_markers = None if opening is None or closing is None else (opening, closing)

    def parse(
        self,
        parser: Callable[..., RequestSpec],
        raw: bytes,
        content_type: str | None,
        **extra: Any,
    ) -> RequestSpec:
        """``parser`` (``api/pipeline.py``) on a body, with this model's defaults and
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
    tools = spec.tools.tools if spec.tools is not None else None
    try:
        prompt_ids = engine.chat_prompt_ids(spec.messages, tools)
        if spec.tools is not None:
            spec = dataclasses.replace(spec, tools=_tool_format(spec, prompt_ids, engine))
            spec = _auto_tools_constrained(spec, facts)
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
    if spec.suffix:
        suffix_ids = engine.suffix_ids(spec.suffix)
        check_no_mask_token(suffix_ids, facts.mask_id, "suffix")
        spec = dataclasses.replace(
            spec, params=dataclasses.replace(spec.params, suffix_ids=tuple(suffix_ids))
        )
    return _fitted(spec, prompt_ids, engine, "prompt")


def _tool_format(spec: RequestSpec, prompt_ids: list[int], engine: AsyncEngine) -> ToolSpec:
    """The request's tools with the parser of the model's format; a 400 when the model's
    chat template does not render tools (they would be silently ignored) or no parser knows
    its call format."""
    assert spec.tools is not None and spec.messages is not None
    if spec.tools.forced:
        # The grammar makes the call; a template that renders no tools only means the model
        # does not read their descriptions.
        return spec.tools
    if engine.chat_prompt_ids(spec.messages) == prompt_ids:
        raise invalid(
            "This model's chat template does not render tools, so the model would never see "
            "them; omit 'tools'.",
            "tools",
            code="not_applicable",
        )
    parser = parser_for(engine.chat_template)
    if parser is None and spec.tools.parse:
        raise invalid(
            "No tool-call parser knows this model's format (its chat template renders the "
            "tools, but not in a format this server parses: hermes <tool_call> blocks); "
            "omit 'tools' or send 'tool_choice': 'none'.",
            "tools",
            code="not_applicable",
        )
    return dataclasses.replace(spec.tools, parser=parser)


def _auto_tools_constrained(spec: RequestSpec, facts: ModelFacts) -> RequestSpec:
    """An ``auto`` request in the hermes format decoded under the grammar "text, or text then
    valid calls" (``ToolSpec.auto_grammar``) where its decoding enforces grammars; elsewhere
    (a mode that does not, an editing rule, ``ignore_eos``, a ``response_format`` of its
    own) the answer is parsed as it comes, and a block that is not a valid call stays text."""
    tools, params = spec.tools, spec.params
    assert tools is not None
    mode = params.decoding_mode or facts.default_mode or ""
    if (
        not tools.parse
        or tools.parser != "hermes"
        or params.grammar is not None
        or params.ignore_eos
        or params.edit_threshold is not None
        or mode in dict(facts.decoding.structured_refusals)
    ):
        return spec
    try:
        grammar = tools.auto_grammar(facts.tool_markers)
    except GrammarError as exc:
        raise invalid(f"tools: {exc}", "tools") from None
    unrounded = spec.unrounded
    return dataclasses.replace(
        spec,
        params=dataclasses.replace(params, grammar=grammar),
        unrounded=None if unrounded is None else dataclasses.replace(unrounded, grammar=grammar),
    )


def _fitted(
    spec: RequestSpec, prompt_ids: list[int], engine: AsyncEngine, prompt_param: str
) -> tuple[RequestSpec, list[int]]:
    """The spec fitted to the prompt's length (``RequestSpec.fitted``), which must then leave
    room for the canvas in the model's context, and whose K/V must fit the whole KV pool."""
    # An infilling suffix sits after the canvas: it takes context like the prompt.
    context = len(prompt_ids) + len(spec.params.suffix_ids)
    spec = spec.fitted(context, engine.max_length)
    check_context_length(
        context, spec.params.gen_length, engine.max_length, prompt_param, spec.canvas_param
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
