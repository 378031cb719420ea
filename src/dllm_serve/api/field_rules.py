"""Per-field request rules of the API contract (docs/api-contract.md): autoregressive-only
fields, fields not available yet, and combinations of the decoding extensions that would
silently do nothing (all 400s)."""

from __future__ import annotations

from typing import Any

from dllm_serve.api.errors import CONTRACT_REF, APIError, invalid
from dllm_serve.api.protocol import ChatCompletionRequest, CompletionRequest
from dllm_serve.decoding.params import DecodingParams

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
)


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
    if req.n is not None and req.n > 1:
        raise _ar_only("n", "multiple completions per request are deferred", "n=1")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0):
            raise _ar_only(name, "per-token penalties are autoregressive-only", f"{name}=0")
    if req.logit_bias:
        raise _ar_only("logit_bias", "logit bias is deferred", "an empty logit_bias")
    if isinstance(req, ChatCompletionRequest):  # /v1/completions: logprobs is an int, see there
        if req.logprobs:
            raise _ar_only("logprobs", "log probabilities are deferred", "logprobs=false")
        if req.top_logprobs:
            raise _ar_only("top_logprobs", "log probabilities are deferred", "top_logprobs=0")
        if req.tools:
            raise _ar_only("tools", "function calling is out of scope", "an empty tools list")
        if req.functions:
            raise _ar_only("functions", "function calling is out of scope", "an empty list")
        for name in ("tool_choice", "function_call"):
            if getattr(req, name) not in (None, "none"):
                raise _ar_only(name, "function calling is out of scope", f'{name}="none"')
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
    response_format = getattr(req, "response_format", None)  # chat only
    if response_format is not None and response_format != {"type": "text"}:
        raise invalid(
            f'Only response_format {{"type": "text"}} is supported; structured output {NOT_YET}.',
            "response_format",
            code="not_available_yet",
        )
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
    data_dependent = req.use_local_leap or req.confidence_threshold is not None
    if data_dependent and req.block_schedule not in (None, "uniform"):
        mode = "use_local_leap" if req.use_local_leap else "confidence_threshold"
        raise invalid(
            f"block_schedule '{req.block_schedule}' has no effect with '{mode}': that mode "
            "commits a data-dependent number of tokens per step instead of following a "
            "schedule. Omit 'block_schedule' (or use 'uniform').",
            "block_schedule",
        )


def local_leap_settings(req: Request) -> dict[str, Any]:
    """The LocalLeap fields the client set (the rest keep DecodingParams' defaults)."""
    return {
        name: getattr(req, name) for name in LOCAL_LEAP_PARAMS if getattr(req, name) is not None
    }
