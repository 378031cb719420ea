"""Pydantic v2 models of the wire format: the chat request (ADR 005) and the responses.

The request model only checks types and ranges; what a value *means* for diffusion decoding
(defaults, divisibility, fields that are rejected) is decided in ``validation.py``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

INT64_MIN = -(2**63)
UINT64_MAX = 2**64 - 1


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool | None = None
    include_obfuscation: bool | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    # str, or a list of {"type": "text", "text": ...} parts; checked in validation.py so the
    # error can name the exact part instead of pydantic's union noise.
    content: Any = None


class ChatCompletionRequest(BaseModel):
    """POST /v1/chat/completions body. Unknown fields are rejected (no silent ignores)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str | None = Field(None, description="Accepted and ignored: one server = one model.")
    messages: list[ChatMessage]
    temperature: float | None = Field(None, ge=0, le=2, description="0 (default) = greedy.")
    seed: int | None = Field(None, ge=INT64_MIN, le=UINT64_MAX)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1, description="Canvas length (gen_length).")
    max_completion_tokens: int | None = Field(None, ge=1, description="Same as max_tokens.")
    user: str | None = Field(None, description="Informational only, as in OpenAI.")
    response_format: dict[str, Any] | None = Field(None, description='Only {"type": "text"}.')
    stop: Any = Field(None, description="A string or up to 4 strings; checked in validation.py.")
    # Autoregressive-only OpenAI fields: accepted only with their no-op values (ADR 005).
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    n: int | None = Field(None, ge=1, le=128)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    # Diffusion extension fields (ADR 005), top level.
    num_denoising_steps: int | None = Field(None, ge=1, le=512)
    block_length: int | None = Field(None, ge=1)
    block_schedule: Literal["uniform", "front_loaded", "cosine"] | None = None
    confidence_metric: Literal["top1_prob", "entropy_inverse"] | None = None
    target_length: int | None = Field(None, ge=1, description="Overrides the canvas length.")
    attention_backend: Literal["sdpa", "fa2"] | None = None
    force_single_batch: bool | None = None
    use_local_leap: bool | None = None
    local_leap_anchor_threshold: float | None = Field(
        None, ge=0, le=1, description="LocalLeap anchor threshold κ (default 0.9)."
    )
    local_leap_neighbor_threshold: float | None = Field(
        None, ge=0, le=1, description="LocalLeap neighbour threshold τ ≤ κ (default 0.75)."
    )
    local_leap_radius: int | None = Field(
        None, ge=1, le=16, description="LocalLeap radius W (default 4)."
    )
    confidence_threshold: float | None = Field(
        None, gt=0, le=1, description="Threshold (Fast-dLLM) parallel decoding; off by default."
    )


class DiffusionUsage(BaseModel):
    nfe: int = Field(description="Model forward passes spent on this request.")
    canvas_length: int = Field(description="Masked positions the request decoded over.")
    committed_tokens: int = Field(description="Canvas positions committed (incl. EOS padding).")
    tokens_per_forward: float = Field(description="committed_tokens / nfe.")
    drafted_tokens: int | None = Field(None, description="I-DLM self-speculation only.")
    accepted_drafts: int | None = Field(None, description="I-DLM self-speculation only.")
    acceptance_rate: float | None = Field(None, description="accepted_drafts / drafted_tokens.")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    diffusion: DiffusionUsage | None = None


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: None = None


class Choice(BaseModel):
    index: int = 0
    message: ResponseMessage
    logprobs: None = None
    finish_reason: Literal["stop", "length"]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dllm-serve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
