"""Every request field's rule: what each field means for the served model, and the 400 that
refuses a field or combination this server cannot honour (the contract in
docs/api-contract.md). Free of the web framework, so the offline ``LLM`` applies the same rules.

- **Fields**: autoregressive-only fields, fields accepted with their no-op values only, fields
  not available yet, and combinations of the decoding extensions that would silently do nothing.
- **Modes**: which fields apply to the model's decoding mode, and which modes a request may
  name (``decoding_mode``).
- **Parameters**: ``max_tokens`` and ``target_length`` set the canvas, ``block_length`` and
  ``num_denoising_steps`` split it, and a long canvas without ``block_length`` is decoded in
  the model's recommended block: the fields become :class:`DecodingParams`.
- **Messages**: chat messages become plain ``{role, content}`` dicts for the chat template.
  What the API itself returns (an assistant message with ``refusal``/``annotations``…
  ``null``), ``developer`` as ``system`` and text-part lists are accepted; anything else is a
  400 naming the message field.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from dllm_serve.api.errors import CONTRACT_REF, APIError, invalid
from dllm_serve.api.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from dllm_serve.api.tools import assistant_tool_calls
from dllm_serve.decoding.grammar import GrammarError, response_format_grammar
from dllm_serve.decoding.params import (
    DEFAULT_STEPS,
    DESCRIPTIONS,
    DIFFUSION,
    RULE_FIELDS,
    TRI_MODE,
    TRI_MODES,
    DecodingParams,
    model_mode,
)

# ---- fields ------------------------------------------------------------------------------------


LOCAL_LEAP_PARAMS = (
    "local_leap_anchor_threshold",
    "local_leap_neighbor_threshold",
    "local_leap_radius",
)
NOT_YET = "is not available yet in this server version"
Request = ChatCompletionRequest | CompletionRequest
DEFAULT_LEAP = DecodingParams()  # LocalLeap defaults (κ 0.9, τ 0.75, W 4) live in one place

# Fields that steer canvas denoising and mean nothing to a self-speculative model.
DIFFUSION_ONLY = (
    "num_denoising_steps",
    "block_length",
    "block_schedule",
    "confidence_metric",
    "confidence_threshold",
    "use_local_leap",
    *LOCAL_LEAP_PARAMS,
    "entropy_bound",
    "entropy_threshold",
    "edit_threshold",
    "max_post_edit_steps",
)
# The commit rules a request picks by setting their field (at most one; edit_threshold reads
# confidence_threshold as its mask threshold).


def _ar_only(param: str, what: str, accepted: str) -> APIError:
    return invalid(
        f"'{param}' is not supported by diffusion decoding: {what}. Only {accepted} is "
        f"accepted; {CONTRACT_REF}.",
        param,
        code="unsupported_parameter",
    )


def reject_autoregressive_fields(req: Request) -> None:
    if req.top_p is not None and req.top_p != 1:
        raise _ar_only("top_p", "nucleus sampling is autoregressive-only", "top_p=1")
    if req.top_k is not None and req.top_k > 1:
        raise _ar_only("top_k", "top-k sampling is out of scope for v0.1", "top_k<=1")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0):
            raise _ar_only(name, "per-token penalties are autoregressive-only", f"{name}=0")
    if req.logit_bias:
        raise _ar_only("logit_bias", "logit bias is deferred", "an empty logit_bias")
    if isinstance(req, ChatCompletionRequest):  # /v1/completions: logprobs is an int, see there
        if req.top_logprobs and not req.logprobs:
            raise invalid(
                "'top_logprobs' needs 'logprobs': true (the alternatives come with each token's "
                "log-probability).",
                "top_logprobs",
            )
        if req.functions:
            raise _ar_only("functions", "the legacy functions API is not supported (use "
                           "'tools')", "an empty list")  # fmt: skip
        if req.function_call not in (None, "none"):
            raise _ar_only("function_call", "the legacy functions API is not supported (use "
                           "'tool_choice')", 'function_call="none"')  # fmt: skip
    if req.best_of not in (None, 1):
        raise _ar_only("best_of", "several candidates per request are deferred", "best_of=1")
    if req.repetition_penalty not in (None, 1):
        raise _ar_only("repetition_penalty", "per-token penalties are autoregressive-only", "1")


def _no_op_only(param: str, what: str, accepted: str) -> APIError:
    return invalid(
        f"'{param}' {what}. Only {accepted} is accepted; {CONTRACT_REF}.",
        param,
        code="unsupported_parameter",
    )


def reject_noop_fields(req: Request) -> None:
    """OpenAI and vLLM fields that are accepted with their no-op values only."""
    if req.echo:
        raise _no_op_only("echo", "(repeating the prompt in the answer) is not supported", "false")
    if req.min_tokens not in (None, 0):
        raise _no_op_only(
            "min_tokens",
            "is not supported: the canvas length is fixed and the model decides where the "
            "answer ends (use ignore_eos for fixed-length output)",
            "0",
        )
    if req.skip_special_tokens is False:
        raise _no_op_only(
            "skip_special_tokens", "is not supported: answers never contain special tokens", "true"
        )
    if req.store:
        raise _no_op_only("store", "is not supported: this server stores nothing", "false")
    if req.service_tier not in (None, "auto", "default"):
        raise _no_op_only(
            "service_tier",
            f"'{req.service_tier}' is not offered: there is one tier",
            "'auto' or 'default'",
        )
    if not isinstance(req, ChatCompletionRequest):
        return
    if req.modalities is not None and req.modalities != ["text"]:
        raise _no_op_only("modalities", "other than text are not supported", '["text"]')
    for name, what in (
        ("audio", "output is not supported"),
        ("prediction", "(predicted outputs) is not supported"),
        ("reasoning_effort", "does not apply: this server has no reasoning models"),
    ):
        if getattr(req, name) is not None:
            raise _no_op_only(name, what, "null")


def reject_unavailable_fields(req: Request) -> None:
    if req.attention_backend == "fa2":
        raise invalid(
            "attention_backend 'fa2' is deferred until an FA2 build is in CI; 'sdpa' is the "
            f"reference path ({CONTRACT_REF}).",
            "attention_backend",
            code="not_available_yet",
        )


def check_commit_rule(req: Request) -> None:
    """Combinations of the decoding extensions that would silently do nothing are 400s."""
    if not req.use_local_leap:
        for name in LOCAL_LEAP_PARAMS:
            if getattr(req, name) is not None:
                raise invalid(
                    f"'{name}' configures LocalLeap; set 'use_local_leap': true to use it.", name
                )
    else:
        if req.confidence_threshold is not None:
            raise invalid(
                "'confidence_threshold' and 'use_local_leap' are mutually exclusive: LocalLeap "
                "commits every position whose confidence reaches 'local_leap_anchor_threshold' "
                "(its threshold) plus relaxed neighbours; set that instead.",
                "confidence_threshold",
            )
        leap = local_leap_settings(req)
        kappa = leap.get("local_leap_anchor_threshold", DEFAULT_LEAP.local_leap_anchor_threshold)
        tau = leap.get("local_leap_neighbor_threshold", DEFAULT_LEAP.local_leap_neighbor_threshold)
        if tau > kappa:
            raise invalid(
                f"'local_leap_neighbor_threshold' ({tau}) must not exceed "
                f"'local_leap_anchor_threshold' ({kappa}): neighbours of an anchor are "
                "committed at a relaxed (lower or equal) threshold.",
                "local_leap_neighbor_threshold",
            )
    _check_entropy_and_edit_rules(req)
    chosen = [name for name in RULE_FIELDS if getattr(req, name)
              not in (None, False)]  # fmt: skip
    if chosen and req.block_schedule not in (None, "uniform"):
        mode = chosen[0]
        raise invalid(
            f"block_schedule '{req.block_schedule}' has no effect with '{mode}': that mode "
            "commits a data-dependent number of tokens per step instead of following a "
            "schedule. Omit 'block_schedule' (or use 'uniform').",
            "block_schedule",
        )


def _check_entropy_and_edit_rules(req: Request) -> None:
    """The entropy rules and token editing: one commit rule per request, and no field that
    would configure a rule the request does not use."""
    for name in ("entropy_bound", "entropy_threshold"):
        if getattr(req, name) is None:
            continue
        for other in RULE_FIELDS:
            if other != name and getattr(req, other) not in (None, False):
                raise invalid(
                    f"'{name}' and '{other}' choose different commit rules; set one of them.",
                    other,
                )
        if req.confidence_metric is not None:
            raise invalid(
                f"'confidence_metric' does not apply with '{name}': that rule ranks positions "
                "by the entropy of their predicted distribution. Omit 'confidence_metric'.",
                "confidence_metric",
            )
    if req.edit_threshold is None:
        if req.max_post_edit_steps is not None:
            raise invalid(
                "'max_post_edit_steps' configures token editing; set 'edit_threshold' to use it.",
                "max_post_edit_steps",
            )
        return
    if req.use_local_leap:
        raise invalid(
            "'edit_threshold' and 'use_local_leap' choose different commit rules: token "
            "editing commits masks above 'confidence_threshold' (its mask threshold). Omit "
            "'use_local_leap'.",
            "use_local_leap",
        )


def check_editing(req: Request, model: ModelDecoding) -> None:
    """Token editing (``edit_threshold``) only on a model trained to edit (LLaDA2.x); on a
    LLaDA2.2 checkpoint (insert/delete editing, JointThresholdInDel) greedy and without
    logprobs (called after the model's default rule is applied, which may have set it)."""
    if req.edit_threshold is not None and not model.token_editing:
        raise invalid(
            "'edit_threshold' (token editing) applies to LLaDA2.x models, which were trained to "
            "rewrite the tokens of the open block; this model was not, and its answers would "
            "only get worse. Omit it.",
            "edit_threshold",
            code="not_applicable",
        )
    if req.edit_threshold is None or not model.insert_delete:
        return
    # Stated here again (api/ does not import the decoders): decoding/registry.py's
    # insert_delete_refusal is the engine's own check of the same two limits.
    how = (
        "This model decodes editing requests (edit_threshold, set by the request or by the "
        "model's default rule) by LLaDA2.2's insert/delete editing (JointThresholdInDel): "
    )
    if req.temperature:
        raise invalid(
            how + "the rule is greedy, as SGLang's; set temperature 0, or choose another "
            "commit rule (e.g. confidence_threshold) to sample.",
            "temperature",
            code="not_applicable",
        )
    if logprob_count(req) is not None:
        raise invalid(
            how + "logprobs are not recorded, since DELETE and SPLIT move tokens between "
            "positions. Omit logprobs, or choose another commit rule.",
            "logprobs",
            code="not_applicable",
        )


def logprob_count(req: Request) -> int | None:
    """The alternatives per token a request asks for: chat ``logprobs: true`` with
    ``top_logprobs`` (default 0), a completion's ``logprobs`` integer; None: no logprobs."""
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def local_leap_settings(req: Request) -> dict[str, Any]:
    """The LocalLeap fields the client set (the rest keep DecodingParams' defaults)."""
    return {
        name: getattr(req, name) for name in LOCAL_LEAP_PARAMS if getattr(req, name) is not None
    }


# ---- modes -------------------------------------------------------------------------------------


# What a request's canvas fields (num_denoising_steps, block_length) mean, by how it decodes.
CANVAS = "canvas"  # LLaDA, Dream: one canvas of max_tokens, in blocks the request may choose
# DiffusionGemma: uniform-state canvases of the checkpoint's length, denoised by the entropy-
# bounded renoise sampler; num_denoising_steps per canvas, max_tokens across canvases.
RENOISE = "renoise"
BLOCK = "block"  # block diffusion: the trained block, aligned to position 0; steps per block
NO_CANVAS = "none"  # self-speculation, ar, linear_spec: no denoising steps or blocks


@dataclass(frozen=True, slots=True)
class ModelDecoding:
    """What the served model's decoding lets a request choose (read once from the engine).

    ``kind`` is the engine's algorithm kind (``diffusion``, ``block_diffusion``,
    ``self_speculation`` or ``tri_mode``), ``block_size`` a block model's trained block and
    ``default_mode`` a tri-mode model's mode for requests that name none.
    """

    kind: str
    block_size: int | None = None
    default_mode: str | None = None
    # DiffusionGemma (kind "renoise"): its canvas and the checkpoint's max_denoising_steps.
    canvas_length: int | None = None
    max_denoising_steps: int | None = None
    token_editing: bool = False  # requests may ask for JointThreshold (LLaDA2.x)
    # Editing requests decode by JointThresholdInDel (LLaDA2.2: DELETE and SPLIT edit tokens).
    insert_delete: bool = False
    infilling: bool = False  # /v1/completions suffix (bidirectional canvas denoising)
    # The request modes whose logprobs the engine records (engine/logprobs.py); None: all.
    logprob_modes: tuple[str, ...] | None = None
    # (request mode, why response_format is not enforced there) for the modes that refuse it
    # (decoding/grammar.py); empty: every mode enforces it.
    structured_refusals: tuple[tuple[str, str], ...] = ()
    # --decoding-algorithm: the rule fields of requests that set none of RULE_FIELDS.
    default_rule: tuple[tuple[str, float], ...] = ()

    def check_logprobs(self, req: Request) -> None:
        """Logprobs only where the engine records them: canvas denoising, block diffusion and
        self-speculation, not the seeded block decoders (Fast-dLLM v2, a tri-mode model's
        ``diffusion``) or DiffusionGemma."""
        if logprob_count(req) is None or self.logprob_modes is None:
            return
        mode = (
            req.decoding_mode
            or self.default_mode
            or (model_mode(self.kind) if self.kind != TRI_MODE else None)
        )
        if mode not in self.logprob_modes:
            raise invalid(
                "'logprobs' are not recorded for this model's decoding "
                f"({mode}): a block decoder that places seed tokens beside the committed ones "
                "(Fast-dLLM v2, a tri-mode model's diffusion mode) or DiffusionGemma's "
                "re-drawn canvases. They are for canvas denoising, block diffusion and "
                "self-speculation (a tri-mode model's ar and linear_spec). Omit it.",
                "logprobs",
                code="not_applicable",
            )

    def check_response_format(self, req: Request) -> str | None:
        """The grammar of a chat request's ``response_format`` (None: free text); a format
        that cannot be enforced on this model, or not at all, is a 400 (never free text)."""
        grammar = response_format_grammar_of(req)
        if grammar is None:
            return None
        refusal = dict(self.structured_refusals).get(req.decoding_mode or self.default_mode or "")
        if refusal is not None:
            raise invalid(
                f"response_format is not enforced on this model: {refusal}. "
                'Omit it (or send {"type": "text"}).',
                "response_format",
                code="not_applicable",
            )
        if req.edit_threshold is not None:
            raise invalid(
                "response_format cannot be combined with token editing (edit_threshold): an "
                "edit could rewrite text the grammar has already accepted.",
                "response_format",
                code="not_applicable",
            )
        if req.ignore_eos:
            raise invalid(
                "response_format with ignore_eos: a structured answer ends with the model's "
                "stop id once it is complete; ignore_eos would forbid that end.",
                "response_format",
                code="not_applicable",
            )
        return grammar

    def with_default_rule(self, req: Request) -> Request:
        """``req`` with the server's default commit rule when it chose none (a denoising
        request only: the caller checked the mode)."""
        if not self.default_rule or any(getattr(req, f) not in (None, False) for f in RULE_FIELDS):
            return req
        return req.model_copy(update=dict(self.default_rule))

    def canvas_rules(self, requested: str | None) -> str:
        """:data:`CANVAS`, :data:`BLOCK` or :data:`NO_CANVAS` for a request naming
        ``requested`` as its ``decoding_mode`` (None: the model's default)."""
        if self.kind == "diffusion":
            return CANVAS
        if self.kind == "renoise":
            return RENOISE
        if self.kind == "block_diffusion":
            return BLOCK
        if self.kind == TRI_MODE and (requested or self.default_mode) == DIFFUSION:
            return BLOCK
        return NO_CANVAS

    def self_speculative(self, requested: str | None) -> bool:
        """Whether a request naming ``requested`` decodes by self-speculation (I-DLM's ISD, a
        tri-mode model's ``ar`` or ``linear_spec``): its usage carries the draft counters."""
        if self.kind == "self_speculation":
            return True
        return self.kind == TRI_MODE and (requested or self.default_mode) != DIFFUSION

    def commit_rules(self) -> list[str]:
        """The commit rules a denoising request may pick (none for self-speculation or
        DiffusionGemma's renoise sampler; a tri-mode model's apply to its ``diffusion``
        mode), as ``/v1/dllm/info`` lists them."""
        if self.kind in ("self_speculation", "renoise"):
            return []
        rules = ["topk", "threshold", "local_leap", "entropy_bound", "entropy_threshold"]
        return [*rules, "joint_threshold"] if self.token_editing else rules

    def diffusion_fields(self) -> list[str]:
        """The denoising extension fields a request may set (see :meth:`commit_rules`)."""
        if self.kind == "self_speculation":
            return []
        if self.kind == "renoise":
            return ["num_denoising_steps", "entropy_bound"]
        editing = ("edit_threshold", "max_post_edit_steps")
        return [f for f in DIFFUSION_ONLY if self.token_editing or f not in editing]


def check_decoding_mode(
    requested: str | None,
    block_length: int | None,
    diffusion_fields: Sequence[str],
    model: ModelDecoding,
) -> None:
    """``requested`` and ``block_length`` are the request's ``decoding_mode`` and
    ``block_length`` (None: not set), ``diffusion_fields`` the denoising fields it set."""
    kind, block_size, default_mode = model.kind, model.block_size, model.default_mode
    if kind == TRI_MODE:
        mode = requested or default_mode or ""
        if mode not in TRI_MODES:
            raise invalid(
                f"'decoding_mode' '{mode}' is not available for this model: it is a tri-mode "
                "model and decodes by 'ar', 'diffusion' or 'linear_spec'. Omit "
                f"'decoding_mode' to use the server's default ('{default_mode}').",
                "decoding_mode",
                code="not_applicable",
            )
        if mode == DIFFUSION:
            _check_block(block_length, diffusion_fields, block_size, "its diffusion mode decodes")
        elif diffusion_fields:
            name = diffusion_fields[0]
            raise invalid(
                f"'{name}' configures diffusion denoising, but this request decodes by "
                f"'{mode}' ({DESCRIPTIONS[mode]}): it has no denoising steps, blocks, schedules "
                "or commit thresholds. Omit it, or set 'decoding_mode': 'diffusion'.",
                name,
                code="not_applicable",
            )
        return
    own = model_mode(kind)
    if requested is not None and requested != own:
        raise invalid(
            f"'decoding_mode' '{requested}' is not available for this model: it decodes only "
            f"by '{own}' ({DESCRIPTIONS[own]}). Omit 'decoding_mode' or set it to '{own}'.",
            "decoding_mode",
            code="not_applicable",
        )
    if kind == "block_diffusion":
        _check_block(block_length, diffusion_fields, block_size, "it is a block-diffusion model")
    if kind == "renoise":
        _check_renoise(diffusion_fields, model)
    if kind == "self_speculation" and diffusion_fields:
        name = diffusion_fields[0]
        raise invalid(
            f"'{name}' configures diffusion denoising, but this model decodes by exact "
            "self-speculation (I-DLM): it has no denoising steps, blocks, schedules or commit "
            "thresholds. Omit it; max_tokens, temperature, seed and stop apply.",
            name,
            code="not_applicable",
        )


# Why each field that steers masked denoising does not apply to a renoise model.
_RENOISE_NOT = {
    "block_length": "its canvas is one block of the checkpoint's canvas_length",
    "target_length": "its canvas is the checkpoint's canvas_length; max_tokens limits the answer",
    "block_schedule": "it follows no commit schedule",
    "confidence_metric": "its sampler ranks positions by entropy only",
    "confidence_threshold": "it accepts positions by an entropy bound (use 'entropy_bound')",
    "use_local_leap": "it has no masks to commit",
    "entropy_threshold": "it accepts positions by an entropy bound (use 'entropy_bound')",
    "edit_threshold": "token editing is LLaDA2.x's rule for masked blocks",
    "max_post_edit_steps": "token editing is LLaDA2.x's rule for masked blocks",
    **{name: "it has no masks to commit (LocalLeap)" for name in LOCAL_LEAP_PARAMS},
}


def _check_renoise(fields: Sequence[str], model: ModelDecoding) -> None:
    """The mask-based fields are 400s for a uniform-state model, naming why."""
    for name in fields:
        if name in _RENOISE_NOT:
            raise invalid(
                f"'{name}' does not apply to this model: it is a uniform-state diffusion model "
                "(DiffusionGemma) whose canvas starts as random tokens and is re-drawn each "
                "step by an entropy-bounded sampler, with no mask token; "
                f"{_RENOISE_NOT[name]}. Omit it; num_denoising_steps (at most "
                f"{model.max_denoising_steps}), entropy_bound, seed and max_tokens apply.",
                name,
                code="not_applicable",
            )


RENOISE_FIELDS = (
    "max_tokens",
    "num_denoising_steps",
    "entropy_bound",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "force_single_batch",
)


def renoise_info(model: ModelDecoding) -> dict[str, Any]:
    """``/v1/dllm/info``'s DiffusionGemma part: its mode, canvas, step limit and which request
    fields apply or are refused (empty for every other model)."""
    if model.kind != "renoise":
        return {}
    return {
        "modes": [model_mode(model.kind)],
        "sampler": "entropy_bound_renoise",
        "canvas_length": model.canvas_length,
        "max_denoising_steps": model.max_denoising_steps,
        "fields": list(RENOISE_FIELDS),
        "refused_fields": ["temperature", *_RENOISE_NOT],
    }


def _check_block(
    block_length: int | None, fields: Sequence[str], block_size: int | None, what: str
) -> None:
    """Block-diffusion decoding runs in the checkpoint's trained block: another one is a 400."""
    if "block_length" in fields and block_length != block_size:
        raise invalid(
            f"'block_length' must be {block_size} for this model: {what} in the block it was "
            "trained with (bidirectional inside a block, causal across blocks), and other "
            "blocks are not what it learned. Omit it.",
            "block_length",
            code="not_applicable",
        )


# ---- parameters --------------------------------------------------------------------------------


MAX_STEPS = 512

GenerationRequest = Any  # a ChatCompletionRequest or a CompletionRequest


def decoding_params(
    req: GenerationRequest,
    default_gen_length: int,
    default_block_length: int | None,
    round_canvas: bool = False,
    rules: str = CANVAS,
    block_size: int | None = None,
    model: ModelDecoding | None = None,
) -> DecodingParams:
    """The request's decoding parameters (a 400 for any field or combination that cannot be).

    ``round_canvas`` (canvas denoising models): a long canvas that the model's block does not
    divide is rounded up to whole blocks and the answer is cut at ``max_tokens``, rather than
    decoded as one block far longer than the model was trained on.

    ``rules`` (the modes above): the canvas rules below apply to :data:`CANVAS`
    requests only. A :data:`BLOCK` request decodes in the model's trained ``block_size``
    whatever ``max_tokens`` is (its decoder rounds the canvas up to whole blocks), and
    ``num_denoising_steps`` is per block, by default one token per step; a
    :data:`NO_CANVAS` request has no steps or blocks at all.
    """
    max_completion_tokens = getattr(req, "max_completion_tokens", None)
    max_tokens = max_completion_tokens or req.max_tokens
    if req.max_tokens and max_completion_tokens and req.max_tokens != max_completion_tokens:
        raise invalid(
            "'max_tokens' and 'max_completion_tokens' are the same setting and were given "
            "different values.",
            "max_completion_tokens",
        )
    if req.target_length is not None and max_tokens is not None and max_tokens < req.target_length:
        named = "max_completion_tokens" if max_completion_tokens else "max_tokens"
        raise invalid(
            f"'target_length' ({req.target_length}) sets the canvas length and exceeds "
            f"{named} ({max_tokens}).",
            "target_length",
        )
    gen_length = req.target_length or max_tokens or default_gen_length
    if rules == RENOISE:
        return _renoise_params(req, gen_length, model)
    if rules != CANVAS:
        return _params_without_canvas(req, gen_length, rules, block_size)
    auto_block = answer_limit = None
    if req.block_length is None and default_block_length:
        auto_block = recommended_block(gen_length, default_block_length)
        long = gen_length > default_block_length  # a canvas within one block stays one
        if auto_block is None and long and round_canvas and req.target_length is None:
            # No block of about the model's size divides the canvas (1001, 997, ...): round
            # the canvas up to whole blocks and keep max_tokens as the answer's limit. An
            # explicit target_length is a canvas the client chose, so it is never rounded.
            rounded = round_up_to_blocks(gen_length, default_block_length)
            # Past MAX_STEPS blocks it stays one block, as recommended_block leaves it (and a
            # canvas that long is refused by the context check of nearly every model).
            if gen_length < rounded <= MAX_STEPS * default_block_length:
                gen_length, answer_limit = rounded, gen_length
                auto_block = default_block_length
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
            # A block the server chose is named as such, not as a block_length the client
            # never sent.
            chosen = (
                ", the block the server chose for this canvas; send block_length to choose another"
                if auto_block is not None and req.block_length is None
                else ""
            )
            raise invalid(
                f"'num_denoising_steps' ({steps}) must be a multiple of the number of blocks "
                f"({num_blocks} = canvas {gen_length} / block_length {block_length}{chosen}).",
                "num_denoising_steps",
            )
    try:
        params = _build_params(req, gen_length, steps, block_length, _temperature(req))
        return params if answer_limit is None else replace(params, answer_limit=answer_limit)
    except ValueError as exc:  # a combination the checks above missed: still a 400, never a 500
        raise invalid(f"Invalid decoding parameters: {exc}.") from None


def _params_without_canvas(
    req: GenerationRequest, gen_length: int, rules: str, block_size: int | None
) -> DecodingParams:
    """A block-diffusion or non-denoising request: ``gen_length`` is the answer budget; the
    params' one block is a formality (the decoders use the model's block, or none)."""
    if rules == BLOCK:
        assert block_size is not None  # every block-diffusion model has its trained block
        # Per block; one token per step by default, however short max_tokens is.
        steps = req.num_denoising_steps or block_size
    else:
        steps = min(DEFAULT_STEPS, gen_length)  # unused: nothing is denoised
    try:
        return _build_params(req, gen_length, steps, None, _temperature(req))
    except ValueError as exc:
        raise invalid(f"Invalid decoding parameters: {exc}.") from None


def _renoise_params(
    req: GenerationRequest, answer_limit: int, model: ModelDecoding | None
) -> DecodingParams:
    """A DiffusionGemma request: ``max_tokens`` limits the answer across canvases, each canvas
    gets ``num_denoising_steps`` (at most, and by default, the checkpoint's
    ``max_denoising_steps``), ``entropy_bound`` overrides the checkpoint's bound. The sampler's
    temperature is the checkpoint's per-step schedule, so a request temperature is a 400."""
    assert model is not None and model.max_denoising_steps is not None
    most = model.max_denoising_steps
    if req.target_length is not None:
        _check_renoise(["target_length"], model)
    for name, set_ in (("temperature", req.temperature is not None), ("top_k", req.top_k == 1)):
        if set_:
            raise invalid(
                f"'{name}' does not apply to this model: DiffusionGemma samples every "
                "denoising step at the checkpoint's temperature schedule (t_max 0.8 on the "
                "first step down to t_min 0.4 on the last, generation_config.json), and the "
                "answer is the argmax of the last step. Omit it; set 'seed' for a "
                "reproducible answer.",
                name,
                code="not_applicable",
            )
    if req.entropy_bound is not None and req.entropy_bound <= 0:
        raise invalid(
            "'entropy_bound' must be > 0 for this model's renoise sampler (as its checkpoint's "
            "generation_config.json requires).",
            "entropy_bound",
        )
    steps = req.num_denoising_steps or most
    if steps > most:
        raise invalid(
            f"'num_denoising_steps' ({steps}) exceeds this model's max_denoising_steps "
            f"({most}, generation_config.json): the temperature schedule and the training "
            "cover at most that many steps per canvas.",
            "num_denoising_steps",
        )
    try:
        return DecodingParams(
            gen_length=answer_limit,
            steps=steps,
            seed=req.seed,
            force_single_batch=bool(req.force_single_batch),
            ignore_eos=bool(req.ignore_eos),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            decoding_mode=req.decoding_mode,
            entropy_bound=req.entropy_bound,
            grammar=response_format_grammar_of(req),
        )
    except ValueError as exc:
        raise invalid(f"Invalid decoding parameters: {exc}.") from None


def _temperature(req: GenerationRequest) -> float:
    if req.top_k == 1:
        return 0.0  # top_k=1 asks for the most likely token: greedy decoding
    return 0.0 if req.temperature is None else req.temperature


def round_up_to_blocks(gen_length: int, block: int) -> int:
    """The shortest canvas of whole blocks that holds ``gen_length`` positions."""
    return -(-gen_length // block) * block


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


def response_format_grammar_of(req: Request) -> str | None:
    """The grammar text of a chat request's ``response_format`` (None: plain text, and for
    /v1/completions, which has no such field); a malformed or uncompilable one is a 400."""
    try:
        return response_format_grammar(getattr(req, "response_format", None))
    except GrammarError as exc:
        raise invalid(f"response_format: {exc}", "response_format") from None


def _build_params(
    req: GenerationRequest,
    gen_length: int,
    steps: int,
    block_length: int | None,
    temperature: float,
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
        entropy_bound=req.entropy_bound,
        entropy_threshold=req.entropy_threshold,
        edit_threshold=req.edit_threshold,
        **(
            {}
            if req.max_post_edit_steps is None
            else {"max_post_edit_steps": req.max_post_edit_steps}
        ),
        ignore_eos=bool(req.ignore_eos),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        logprobs=logprob_count(req),
        grammar=response_format_grammar_of(req),
        decoding_mode=req.decoding_mode,
        **local_leap_settings(req),
    )


# ---- messages ----------------------------------------------------------------------------------


def messages_of(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as the chat template takes them: text content, the assistant's tool
    calls (arguments as objects) and the tool messages that answer them."""
    if not req.messages:
        raise invalid("'messages' must contain at least one message.", "messages")
    out = []
    for i, m in enumerate(req.messages):
        _check_returned_fields(m, i)
        # "developer" is OpenAI's current name for the system role.
        role = "system" if m.role == "developer" else m.role
        calls = assistant_tool_calls(m.tool_calls, f"messages[{i}].tool_calls") if (
            m.tool_calls
        ) else None  # fmt: skip
        if m.tool_calls and role != "assistant":
            raise invalid("Only assistant messages carry 'tool_calls'.",
                          f"messages[{i}].tool_calls")  # fmt: skip
        if role == "tool" and not m.tool_call_id:
            raise invalid("A tool message needs 'tool_call_id' (the call it answers).",
                          f"messages[{i}].tool_call_id")  # fmt: skip
        if m.tool_call_id is not None and role != "tool":
            raise invalid("Only tool messages carry 'tool_call_id'.", f"messages[{i}].tool_call_id")
        # An assistant message that only calls tools has no content (null).
        content = "" if calls and m.content is None else m.content
        message: dict[str, Any] = {
            "role": role, "content": _content_text(content, f"messages[{i}].content"),
        }  # fmt: skip
        if calls:
            message["tool_calls"] = calls
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name  # chat templates that have a slot for it use it
        out.append(message)
    return out


def _check_returned_fields(m: ChatMessage, i: int) -> None:
    """Fields of the assistant message this server returns: only their empty values (tool
    calls are checked by :func:`messages_of`)."""
    if m.function_call is not None:
        raise invalid(
            f"'messages[{i}].function_call' is not supported: the legacy functions API is "
            "not (use 'tool_calls'). Only null is accepted.",
            f"messages[{i}].function_call",
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
