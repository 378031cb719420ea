"""`dllm-serve`: the command line, flags → :class:`ServerConfig` (``serving.py`` serves it).

dllm-serve [--model NAME_OR_DIR] [--host H] [--port P] [--device D] [--dtype T] ...
dllm-serve make-tiny [--family llada|dream|idlm|sdar|llada2|lladamoe|fastdllm|nemotron|
                      diffusion_gemma] DIR
    write a tiny random-weight checkpoint in that family's format (default llada)
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import os
import re
import sys
from collections.abc import Sequence

from dllm_serve.arg_types import finite_float, port
from dllm_serve.config import (
    ATTENTION_BACKENDS,
    KV_CACHE_MODES,
    EngineConfig,
    ModelConfig,
    ServerConfig,
)
from dllm_serve.decoding.params import DECODING_ALGORITHMS, REQUEST_MODES, parse_tiers
from dllm_serve.version import __version__

_DEFAULT = ServerConfig()
# What a Bearer token can carry: visible ASCII, inner spaces allowed.
_API_KEY = re.compile(r"[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?")
# A browser's Origin header: scheme://host[:port] (an IPv6 host in brackets), nothing after.
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://(?:\[[0-9a-f:.]+\]|[a-z0-9._~%-]+)(?::[0-9]{1,5})?")
_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


def flag_names(message: str) -> str:
    """An :class:`EngineConfig` error with its field names written as the flags that set
    them (``max_running_requests`` → ``--max-running-requests``)."""

    def flag(match: re.Match[str]) -> str:
        word = match.group()
        return "--" + word.replace("_", "-") if word in _ENGINE_FIELDS else word

    return re.sub(r"\b[a-z]+(?:_[a-z]+)+\b", flag, message)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dllm-serve",
        description="OpenAI-compatible server for diffusion LLMs. "
        "Subcommand: `dllm-serve make-tiny [--family llada|dream|idlm|sdar|llada2|lladamoe|"
        "fastdllm|nemotron|diffusion_gemma] DIR` writes a tiny random-weight checkpoint in that "
        "family's real format.",
    )
    parser.add_argument(
        "--model",
        default=_DEFAULT.model.model,
        help="embedded model (demo-llada, demo-idlm, demo-trimode, tiny-llada), a local "
        "checkpoint directory, or a Hugging Face id already in the local cache "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--host",
        default=_DEFAULT.host,
        help="bind address (default: %(default)s)",
    )
    parser.add_argument(
        "--port", type=port, default=_DEFAULT.port, help="port, 0-65535 (default: %(default)s)"
    )
    parser.add_argument(
        "--device",
        default=_DEFAULT.model.device,
        help="auto | cpu | cuda | cuda:N; auto picks CUDA when available (default: %(default)s)",
    )
    parser.add_argument(
        "--dtype",
        default=_DEFAULT.model.dtype,
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and activations; auto = float32 on CPU, on CUDA the checkpoint's own "
        "half precision (else bfloat16) (default: %(default)s)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=_DEFAULT.model.tensor_parallel_size,
        metavar="N",
        help="shard the model over N processes (one GPU each on CUDA; gloo on CPU): "
        "attention heads, MLP and vocabulary split N ways; rank 0 serves the API "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--expert-parallel-size",
        type=int,
        default=_DEFAULT.model.expert_parallel_size,
        metavar="N",
        help="mixture-of-experts models: 1 slices every expert over the tensor-parallel ranks; "
        "N = --tensor-parallel-size gives each rank E/N whole experts (default: %(default)s)",
    )
    parser.add_argument(
        "--max-running-requests",
        type=int,
        default=_DEFAULT.engine.max_running_requests,
        help="requests denoised concurrently; more wait in a queue (default: %(default)s)",
    )
    parser.add_argument(
        "--max-tokens-per-forward",
        type=int,
        default=_DEFAULT.engine.max_tokens_per_forward,
        help="real tokens (rows are packed without padding) fused into one forward; larger "
        "groups are split (default: %(default)s)",
    )
    parser.add_argument(
        "--max-waiting-requests",
        type=int,
        default=_DEFAULT.engine.max_waiting_requests,
        help="queued requests beyond the running ones; more get HTTP 429 with Retry-After "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--isd-stride",
        type=int,
        default=_DEFAULT.engine.isd_stride,
        help="I-DLM models: self-speculative stride N (tokens per round at full acceptance; "
        "1 = plain autoregressive decoding) (default: %(default)s)",
    )
    parser.add_argument(
        "--block-size-tiers",
        default="",
        help="I-DLM models: shrink the stride under load, as RUNNING:STRIDE pairs, e.g. "
        "'1:8,8:4,32:2'; tri-mode models: LinearSpec's block the same way, e.g. '4:16,32:8' "
        "(answers do not change; default: no tiers)",
    )
    parser.add_argument(
        "--decoding-mode",
        default=None,
        choices=list(REQUEST_MODES),
        help="the decoding mode of requests that name none (their 'decoding_mode' field). "
        "Tri-mode models (Nemotron-Labs-Diffusion): ar, diffusion or linear_spec (default: "
        "linear_spec); any other model accepts only its own mode (diffusion, or isd for I-DLM)",
    )
    parser.add_argument(
        "--decoding-algorithm",
        default=None,
        choices=list(DECODING_ALGORITHMS),
        help="the commit rule of requests that choose none (no confidence_threshold, "
        "use_local_leap, entropy_bound, entropy_threshold or edit_threshold): low_confidence "
        "(their own fields: top-k by default), s_mode / q_mode (LLaDA2.x token editing, "
        "LLaDA2.1's S and Q presets: confidence_threshold 0.5 / 0.7 with edit_threshold 0.0 / "
        "0.5), eb_sampler (entropy_bound 0.15) or entropy_threshold (0.95) "
        "(default: the model's generation_config.json decoding_algorithm, else low_confidence)",
    )
    parser.add_argument(
        "--draft-lora",
        default=None,
        metavar="DIR",
        help="tri-mode models: a PEFT LoRA on o_proj (adapter_config.json + "
        "adapter_model.safetensors; or demo-trimode-lora, demo-trimode's own) applied in "
        "LinearSpec's draft forwards only; verify "
        "forwards, and so the answers at temperature 0, keep the base weights (default: none)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("DLLM_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $DLLM_API_KEY, else none); "
        "every other path (/health, /metrics, /version, the playground, /docs) stays open",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=_DEFAULT.max_request_bytes,
        help="larger request bodies get HTTP 413 (default: %(default)s)",
    )
    parser.add_argument(
        "--request-timeout",
        type=finite_float,
        default=None,
        help="seconds a request may take; past it the request is aborted and its client gets "
        "504 (or an error event) (default: no limit)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=finite_float,
        default=_DEFAULT.shutdown_timeout,
        help="on SIGTERM/SIGINT, seconds in-flight requests may still finish before they are "
        "aborted (default: %(default)s)",
    )
    parser.add_argument(
        "--cors-origins",
        default="",
        help="comma-separated origins allowed by CORS, e.g. https://app.example.com "
        "(default: CORS off)",
    )
    parser.add_argument(
        "--log-requests",
        action="store_true",
        help="log prompts and answers (off by default: they may be private)",
    )
    parser.add_argument(
        "--log-format", default="text", choices=["text", "json"], help="(default: %(default)s)"
    )
    parser.add_argument(
        "--log-level",
        default=_DEFAULT.log_level,
        choices=["critical", "error", "warning", "info", "debug"],
        help="(default: %(default)s)",
    )
    parser.add_argument(
        "--kv-cache",
        default=_DEFAULT.engine.kv_cache,
        choices=list(KV_CACHE_MODES),
        help="none: every step forwards the whole canvas (exact); prefix: Fast-dLLM's "
        "block-level prefix KV cache, the committed prefix's keys/values computed once per "
        "block and reused by its other steps (faster, approximate) (default: %(default)s)",
    )
    parser.add_argument(
        "--kv-cache-memory",
        type=finite_float,
        default=None,
        metavar="GIB",
        help="GiB preallocated for the KV pool (models that keep K/V: I-DLM, block-diffusion "
        "and tri-mode models, LLaDA/Dream with --kv-cache prefix); a request is admitted "
        "only when its worst-case KV fits, else it waits "
        "(default: 90%% of the GPU memory left after the weights, minus 1 GiB; 1 GiB on CPU; "
        "never more than --max-running-requests full contexts)",
    )
    parser.add_argument(
        "--no-cuda-graph",
        dest="cuda_graph",
        action="store_false",
        help="on CUDA, run every forward eagerly instead of replaying CUDA graphs captured "
        "at start-up (graphs serve any mix of rows up to --cuda-graph-max-tokens tokens, with "
        "the flex attention backend and a KV cache; never on CPU)",
    )
    parser.add_argument(
        "--cuda-graph-max-tokens",
        type=int,
        default=_DEFAULT.engine.cuda_graph_max_tokens,
        metavar="N",
        help="the largest forward, in tokens, that replays a CUDA graph; start-up captures "
        "one graph per bucket of tokens (16, 32, ... up to N) and of logits (default: "
        "%(default)s)",
    )
    parser.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default=_DEFAULT.engine.attention_backend,
        help="attention kernel: flex (FlexAttention over the paged KV pool: one call per layer "
        "for every row, no masks, no K/V copies; compiled per padded length), sdpa (PyTorch's "
        "scaled_dot_product_attention per group of rows, keys gathered from the pool; the "
        "debugging fallback), auto: flex on CUDA, sdpa on CPU (default: %(default)s)",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse the KV pages of earlier requests' prompts and answers across requests "
        "(a shared system prompt, earlier turns of a conversation): a request prefills only "
        "what no cached page holds. Exact, so on by default for I-DLM, block-diffusion "
        "(SDAR, LLaDA2.x, Fast-dLLM v2), tri-mode and DiffusionGemma models; for "
        "LLaDA/Dream/LLaDA-MoE canvas denoising, whose prompt K/V depend on the canvas, only "
        "when given, with --kv-cache prefix (an approximation: docs/decoding.md)",
    )
    parser.add_argument("--version", action="version", version=f"dllm-serve {__version__}")
    return parser


def parse_config(argv: Sequence[str]) -> ServerConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        engine = EngineConfig(
            max_running_requests=args.max_running_requests,
            max_tokens_per_forward=args.max_tokens_per_forward,
            max_waiting_requests=args.max_waiting_requests,
            isd_stride=args.isd_stride,
            block_size_tiers=parse_tiers(args.block_size_tiers),
            kv_cache=args.kv_cache,
            kv_cache_memory=args.kv_cache_memory,
            decoding_mode=args.decoding_mode,
            decoding_algorithm=args.decoding_algorithm,
            cuda_graph=args.cuda_graph,
            cuda_graph_max_tokens=args.cuda_graph_max_tokens,
            attention_backend=args.attention_backend,
            enable_prefix_caching=args.enable_prefix_caching,
        )
    except ValueError as exc:
        parser.error(flag_names(str(exc)))
    host = args.host.strip()  # " 127.0.0.1" would fail only after the model loaded
    if not host:
        # An unset "$HOST" would otherwise bind every interface (uvicorn reads "" as any).
        parser.error("--host must not be empty (127.0.0.1: this machine only; 0.0.0.0: all)")
    cors_origins = tuple(o.strip() for o in args.cors_origins.split(",") if o.strip())
    for origin in cors_origins:
        if origin not in ("*", "null") and not _ORIGIN.fullmatch(origin):
            # A browser's Origin header is exactly scheme://host[:port] in lower case (or
            # "null", from file:// pages and sandboxed frames): any other form (no scheme, a
            # path, a trailing slash, a wildcard, capitals) could never match one.
            parser.error(
                f"--cors-origins: {origin!r} is not an origin; write scheme://host[:port] with "
                "no path or trailing slash, e.g. https://app.example.com"
            )
    if args.tensor_parallel_size < 1:
        parser.error("--tensor-parallel-size must be >= 1")
    if args.expert_parallel_size not in (1, args.tensor_parallel_size):
        parser.error(
            "--expert-parallel-size must be 1 or equal to --tensor-parallel-size (experts are "
            "split over the tensor-parallel ranks)"
        )
    if args.api_key and not _API_KEY.fullmatch(args.api_key):
        # A client sends the key in an HTTP header, which carries ASCII; a key with other
        # characters (or spaces at its ends, which the Bearer parsing strips) could never match.
        parser.error(
            "--api-key (or DLLM_API_KEY) must be visible ASCII characters, with no spaces at "
            "either end"
        )
    if args.max_request_bytes < 1:
        parser.error("--max-request-bytes must be >= 1")
    if args.request_timeout is not None and args.request_timeout <= 0:
        parser.error("--request-timeout must be > 0")
    if args.shutdown_timeout < 0:
        parser.error("--shutdown-timeout must be >= 0")
    return ServerConfig(
        host=host,
        port=args.port,
        log_level=args.log_level,
        log_format=args.log_format,
        log_requests=args.log_requests,
        api_key=args.api_key or None,
        max_request_bytes=args.max_request_bytes,
        request_timeout=args.request_timeout,
        shutdown_timeout=args.shutdown_timeout,
        cors_origins=cors_origins,
        model=ModelConfig(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            draft_lora=args.draft_lora,
            tensor_parallel_size=args.tensor_parallel_size,
            expert_parallel_size=args.expert_parallel_size,
        ),
        engine=engine,
    )


def _subcommands() -> dict[str, importlib.metadata.EntryPoint]:
    """Subcommands other packages register (``make-tiny``: the training package's tiny
    checkpoint writer), so the server package never imports the tools built on it."""
    group = importlib.metadata.entry_points(group="dllm_serve.subcommands")
    return {entry.name: entry for entry in group}


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in _subcommands():
        _subcommands()[argv[0]].load()(argv[1:])
        return
    from dllm_serve.serving import serve

    serve(parse_config(argv))
