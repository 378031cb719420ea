"""Frozen configuration objects, one per layer, built by the CLI from its flags."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dllm_serve.decoding.params import DECODING_ALGORITHMS, DEFAULT_ISD_STRIDE, REQUEST_MODES

KV_CACHE_MODES = ("none", "prefix")
# auto: FlexAttention on CUDA, SDPA on CPU (where the compiled flex kernel is the slower one).
ATTENTION_BACKENDS = ("auto", "flex", "sdpa")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model: str = "demo-llada"  # embedded model name or a local checkpoint directory
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    # A PEFT draft-only LoRA for a tri-mode model (LinearSpec draft forwards only).
    draft_lora: str | None = None
    # Tensor parallelism: ranks (processes, one GPU each on CUDA) that each hold a shard.
    tensor_parallel_size: int = 1
    # MoE models under tensor parallelism: 1 slices every expert over the ranks; equal to
    # tensor_parallel_size splits the experts themselves (expert parallelism).
    expert_parallel_size: int = 1


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_running_requests: int = 32  # rows denoised concurrently
    max_tokens_per_forward: int = 8192  # real tokens (no padding) in one forward
    max_waiting_requests: int = 256  # beyond this, new requests get HTTP 429
    # I-DLM (sdar family) self-speculation: default stride N (1 = plain autoregressive) and
    # the block-size tiers ((min running requests, stride), ...) that shrink it under load.
    isd_stride: int = DEFAULT_ISD_STRIDE
    block_size_tiers: tuple[tuple[int, int], ...] = ()
    kv_cache: str = "none"  # none (exact) | prefix (Fast-dLLM block-level prefix KV cache)
    # GiB of KV pool (every model that keeps K/V: I-DLM, block diffusion, tri-mode, LLaDA/Dream
    # with --kv-cache prefix); None: 90% of free GPU memory after the weights less 1 GiB for
    # activations on CUDA, 1 GiB on CPU, never more than max_running_requests full contexts.
    kv_cache_memory: float | None = None
    # The decoding mode of requests that name none (decoding/params.py): a tri-mode model's
    # default (None: linear_spec); any other model accepts only its own mode here.
    decoding_mode: str | None = None
    # The commit rule of requests that choose none (DECODING_ALGORITHMS in decoding/params.py);
    # None: the model's generation_config.json "decoding_algorithm", else low_confidence.
    decoding_algorithm: str | None = None
    # CUDA graphs (engine/graphs.py; CUDA and the flex attention backend only): every forward
    # of up to cuda_graph_max_tokens tokens replays a graph captured at start-up.
    cuda_graph: bool = True
    cuda_graph_max_tokens: int = 1024
    attention_backend: str = "auto"  # see ATTENTION_BACKENDS
    # Prefix reuse across requests (models/prefix_cache.py): None (auto) turns it on
    # wherever it is exact; True insists (a model where it is not is refused); False: off.
    enable_prefix_caching: bool | None = None

    def __post_init__(self) -> None:
        # Messages name the field; the CLI turns the name into its flag (cli.flag_names).
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.max_tokens_per_forward < 1:
            raise ValueError("max_tokens_per_forward must be >= 1")
        if self.max_waiting_requests < 0:
            raise ValueError("max_waiting_requests must be >= 0")
        if not 16 <= self.cuda_graph_max_tokens <= 8192:
            raise ValueError("cuda_graph_max_tokens must be between 16 and 8192")
        if self.isd_stride < 1:
            raise ValueError("isd_stride must be >= 1")
        if self.kv_cache_memory is not None and not 0 < self.kv_cache_memory < math.inf:
            raise ValueError("kv_cache_memory must be a finite number of GiB > 0")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}")
        if self.kv_cache not in KV_CACHE_MODES:
            raise ValueError(f"kv_cache must be one of {KV_CACHE_MODES}")
        if self.decoding_mode is not None and self.decoding_mode not in REQUEST_MODES:
            raise ValueError(f"decoding_mode must be one of {REQUEST_MODES}")
        if self.decoding_algorithm not in (None, *DECODING_ALGORITHMS):
            raise ValueError(f"decoding_algorithm must be one of {tuple(DECODING_ALGORITHMS)}")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"
    log_format: str = "text"  # text | json
    log_requests: bool = False  # log prompts and answers (off: they may be private)
    api_key: str | None = None  # Bearer token required on /v1/*
    max_request_bytes: int = 4 * 1024 * 1024  # larger bodies get 413
    request_timeout: float | None = None  # seconds; past it the request is aborted (504)
    shutdown_timeout: float = 30.0  # SIGTERM: how long in-flight requests may finish
    cors_origins: tuple[str, ...] = ()  # CORS is off unless origins are given
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
