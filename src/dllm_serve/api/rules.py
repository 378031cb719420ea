"""Every request field's rule: what each field means for the served model, and the 400 that
refuses a field or combination this server cannot honour (the contract in
docs/api-contract.md). Free of the web framework, so the offline ``LLM`` applies the same rules.

- **Fields**: autoregressive-only fields, fields accepted with their no-op values only, fields
  not available yet, and combinations of the decoding extensions that would silently do nothing.
- **Modes**: which fields apply to the model's decoding mode, and which modes a request may
  name (``decoding_mode``).

What the accepted fields become is in :mod:`dllm_serve.api.parameters` (the decoding
parameters) and :mod:`dllm_serve.api.messages` (the chat template's messages).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dllm_serve.api.errors import CONTRACT_REF, APIError, invalid
from dllm_serve.api.protocol import ChatCompletionRequest, CompletionRequest
from dllm_serve.decoding.grammar import GrammarError, response_format_grammar
from dllm_serve.decoding.params import (
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
        check_renoise(diffusion_fields, model)
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


def check_renoise(fields: Sequence[str], model: ModelDecoding) -> None:
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


def response_format_grammar_of(req: Request) -> str | None:
    """The grammar text of a chat request's ``response_format`` (None: plain text, and for
    /v1/completions, which has no such field); a malformed or uncompilable one is a 400."""
    try:
        return response_format_grammar(getattr(req, "response_format", None))
    except GrammarError as exc:
        raise invalid(f"response_format: {exc}", "response_format") from None
