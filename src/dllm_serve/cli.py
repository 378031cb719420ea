"""`dllm-serve`: flags → config → model → engine → uvicorn.

dllm-serve [--model NAME_OR_DIR] [--host H] [--port P] [--device D] [--dtype T] ...
dllm-serve make-tiny DIR      write a tiny random LLaDA-format checkpoint
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from dllm_serve import __version__
from dllm_serve.config import EngineConfig, ModelConfig, ServerConfig

_DEFAULT = ServerConfig()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dllm-serve",
        description="OpenAI-compatible server for diffusion LLMs. "
        "Subcommand: `dllm-serve make-tiny DIR` writes a tiny LLaDA-format checkpoint.",
    )
    parser.add_argument(
        "--model",
        default=_DEFAULT.model.model,
        help="embedded model name (tiny-llada) or a local checkpoint directory "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--host",
        default=_DEFAULT.host,
        help="bind address (default: %(default)s)",
    )
    parser.add_argument(
        "--port", type=int, default=_DEFAULT.port, help="port (default: %(default)s)"
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
        help="weights and activations; auto = float32 on CPU, bfloat16 on CUDA "
        "(default: %(default)s)",
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
        help="padded tokens (rows x longest row) fused into one forward; larger groups are "
        "split (default: %(default)s)",
    )
    parser.add_argument(
        "--max-waiting-requests",
        type=int,
        default=_DEFAULT.engine.max_waiting_requests,
        help="queued requests beyond the running ones; more get HTTP 429 with Retry-After "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--log-level",
        default=_DEFAULT.log_level,
        choices=["critical", "error", "warning", "info", "debug"],
        help="(default: %(default)s)",
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
        )
    except ValueError as exc:
        parser.error(str(exc))
    return ServerConfig(
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        model=ModelConfig(model=args.model, device=args.device, dtype=args.dtype),
        engine=engine,
    )


def serve(config: ServerConfig) -> None:
    import uvicorn

    from dllm_serve.api.app import build_app
    from dllm_serve.engine.engine import AsyncEngine
    from dllm_serve.models.families import UnsupportedModelError
    from dllm_serve.models.loader import ModelLoadError, load_model

    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        loaded = load_model(
            config.model.model, device=config.model.device, dtype=config.model.dtype
        )
    except (ModelLoadError, UnsupportedModelError) as exc:
        sys.exit(f"dllm-serve: cannot load model {config.model.model!r}: {exc}")
    logging.getLogger("dllm_serve").info(
        "serving %s from %s on %s (%s)", loaded.name, loaded.path, loaded.device, loaded.dtype
    )
    app = build_app(AsyncEngine(loaded, config.engine))
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["make-tiny"]:
        from dllm_serve.models.tiny import main as make_tiny

        make_tiny(argv[1:])
        return
    serve(parse_config(argv))
