"""Pydantic v2 models of the wire format: the chat and text-completion requests and the
responses (the contract is docs/api-contract.md).

The request models only check types and ranges; what a value *means* for diffusion decoding
(defaults, divisibility, fields that are rejected) is decided in ``pipeline.py`` and
``rules.py``. ``null`` for any optional field means the same as leaving it out.
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
    continuous_usage_stats: bool | None = Field(
        None, description="vLLM extension: cumulative usage on every chunk."
    )


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # "developer" is OpenAI's current name for "system" (treated as system).
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # str, or a list of {"type": "text", "text": ...} parts; checked in pipeline.py so the
    # error can name the exact part instead of pydantic's union noise.
    content: Any = None
    name: str | None = Field(None, description="Passed to the chat template (where it has one).")
    # Fields of the assistant message this API returns: a client appending the returned
    # message object to its history sends them back. Only their empty values are accepted
    # (null; [] for the lists), checked in pipeline.py.
    refusal: Any = None
    annotations: Any = None
    audio: Any = None
    function_call: Any = None
    tool_calls: Any = None  # an assistant message's calls (a tool round trip; pipeline.py)
    tool_call_id: str | None = Field(None, description="A tool message: the call it answers.")


class _GenerationRequest(BaseModel):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str | None = Field(None, description="Accepted and ignored: one server = one model.")
    temperature: float | None = Field(None, ge=0, le=2, description="0 (default) = greedy.")
    seed: int | None = Field(None, ge=INT64_MIN, le=UINT64_MAX)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1, description="Canvas length (gen_length).")
    user: str | None = Field(None, description="Informational only, as in OpenAI.")
    stop: Any = Field(None, description="A string or up to 4 strings; checked in pipeline.py.")
    # Autoregressive-only OpenAI fields: accepted only with their no-op values
    # (docs/api-contract.md).
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    n: int | None = Field(
        None, ge=1, le=128, description="Choices: rows of the same prompt (seed i: seed + i)."
    )
    # No upper bounds on fields refused past their no-op value: any other value gets the
    # unsupported_parameter 400 (api/rules.py), not a range that suggests it would work.
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    best_of: int | None = Field(None, ge=1, description="Only 1 (one completion per request).")
    echo: bool | None = Field(None, description="Only false.")
    # Informational OpenAI fields (logged only with --log-requests).
    metadata: dict[str, str] | None = None
    store: bool | None = Field(None, description="Only false: nothing is stored.")
    service_tier: str | None = Field(None, description="Only 'auto' or 'default'.")
    # vLLM extensions: honoured, or accepted with their no-op values.
    ignore_eos: bool | None = Field(
        None, description="Decode and return the whole canvas; EOS does not end the answer."
    )
    stop_token_ids: list[int] | None = Field(None, description="Extra token ids that end it.")
    include_stop_str_in_output: bool | None = Field(
        None, description="Keep the matched stop string at the end of the answer."
    )
    min_tokens: int | None = Field(None, ge=0, description="Only 0.")
    repetition_penalty: float | None = Field(None, gt=0, description="Only 1.")
    skip_special_tokens: bool | None = Field(None, description="Only true.")
    # Diffusion extension fields (docs/api-contract.md), top level.
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
    entropy_bound: float | None = Field(
        None,
        ge=0,
        le=1000,
        description="EB-sampler: commit the lowest-entropy positions while "
        "the entropies taken before each sum to at most this (nats); off by default. "
        "DiffusionGemma: its renoise sampler's bound (default: the checkpoint's, 0.1 released).",
    )
    entropy_threshold: float | None = Field(
        None,
        gt=0,
        le=1000,
        description="Commit every position whose entropy (nats) is below "
        "this, and always the lowest; off by default.",
    )
    edit_threshold: float | None = Field(
        None,
        ge=0,
        le=1,
        description="LLaDA2.x token editing (JointThreshold): rewrite a "
        "token of the open block whose new argmax has probability above this.",
    )
    max_post_edit_steps: int | None = Field(
        None,
        ge=0,
        le=1024,
        description="Token editing: mask-free edit steps per block (default 16).",
    )
    decoding_mode: Literal["ar", "diffusion", "linear_spec", "isd"] | None = Field(
        None,
        description="Tri-mode models: 'ar', 'diffusion' or 'linear_spec' (default: the "
        "server's --decoding-mode). Other models accept only their own mode ('diffusion', or "
        "'isd' for I-DLM).",
    )


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions body. Unknown fields are rejected (no silent ignores)."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1, description="Same as max_tokens.")
    response_format: dict[str, Any] | None = Field(
        None,
        description='{"type": "text"} (default), {"type": "json_object"} or {"type": '
        '"json_schema", "json_schema": {"name", "schema", "strict"}}: enforced while decoding '
        "(every mode but DiffusionGemma's; docs/structured-output.md).",
    )
    logprobs: bool | None = Field(
        None,
        description="Each answer token's log-probability from the forward that committed "
        "it (canvas and block-diffusion models).",
    )
    top_logprobs: int | None = Field(
        None, ge=0, le=20, description="Alternatives per token (needs logprobs: true)."
    )
    tools: list[Any] | None = Field(
        None, description="Function tools, rendered by the model's chat template (api/tools.py)."
    )
    tool_choice: Any = Field(None, description="'none' or 'auto' (default with tools).")
    parallel_tool_calls: bool | None = Field(
        None, description="false: at most one tool call per answer."
    )
    functions: list[Any] | None = None
    function_call: Any = None
    prompt_cache_key: str | None = Field(None, description="Informational only.")
    safety_identifier: str | None = Field(None, description="Informational only.")
    modalities: list[str] | None = Field(None, description='Only ["text"].')
    audio: Any = Field(None, description="Only null (no audio output).")
    prediction: Any = Field(None, description="Only null (no predicted outputs).")
    reasoning_effort: Any = Field(None, description="Only null (not a reasoning model).")


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions body: a raw prompt, no chat template."""

    prompt: Any = Field(
        description="A string, a list of token ids, or a list holding one string or one list "
        "of token ids; checked in pipeline.py."
    )
    suffix: str | None = Field(
        None,
        description="Infilling: text after the canvas, which is decoded between the "
        "prompt and it (bidirectional canvas models: LLaDA, Dream).",
    )
    logprobs: int | None = Field(
        None,
        ge=0,
        le=5,
        description="Log-probabilities of the answer tokens, with this many "
        "alternatives each (canvas and block-diffusion models).",
    )


class DiffusionUsage(BaseModel):
    nfe: int = Field(description="Model forward passes spent on this request.")
    canvas_length: int = Field(description="Masked positions the request decoded over.")
    committed_tokens: int = Field(description="Canvas positions committed (incl. EOS padding).")
    tokens_per_forward: float = Field(description="committed_tokens / nfe.")
    drafted_tokens: int | None = Field(
        None, description="Self-speculation only (isd, ar, linear_spec)."
    )
    accepted_drafts: int | None = Field(
        None, description="Self-speculation only (isd, ar, linear_spec)."
    )
    acceptance_rate: float | None = Field(None, description="accepted_drafts / drafted_tokens.")


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(
        0, description="Prompt tokens whose K/V came from the prefix cache (not recomputed)."
    )


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    diffusion: DiffusionUsage | None = None


class ToolCallFunction(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI returns it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCall] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]
    refusal: None = None


class Choice(BaseModel):
    index: int = 0
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"]


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


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"]


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
