"""Serve a :class:`ServerConfig`: model (or tensor-parallel group) → engine → uvicorn.

Start-up refusals (a model that does not load, flags it does not take) are one line on
stderr and exit status 1, with any tensor-parallel workers stopped first.
"""

from __future__ import annotations

import logging
import sys
from typing import NoReturn

import uvicorn

from dllm_serve.api.app import build_app
from dllm_serve.api.server import DrainingServer
from dllm_serve.config import ServerConfig
from dllm_serve.engine.engine import AsyncEngine
from dllm_serve.engine.parallel.rendezvous import multi_node_rank
from dllm_serve.engine.workers import launch, worker_main
from dllm_serve.logs import configure_logging
from dllm_serve.models.families import UnsupportedModelError
from dllm_serve.models.loader import LoadedModel, ModelLoadError, load_model
from dllm_serve.models.lora import attach_served_draft_lora


def serve(config: ServerConfig) -> None:
    log_config = configure_logging(config.log_level, config.log_format)
    loaded = _load(config)
    if loaded is None:  # this process was a launcher-started worker rank, now done
        return
    try:
        engine = AsyncEngine(loaded, config.engine)
    except ValueError as exc:  # e.g. a --decoding-mode the model does not have
        _exit_refused(loaded, f"dllm-serve: {exc}")
    # After the engine: a refused flag must not be preceded by "serving".
    logging.getLogger("dllm_serve").info(
        "serving %s from %s on %s (%s)", loaded.name, loaded.path, loaded.device, loaded.dtype
    )
    app = build_app(engine, config)
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        log_config=log_config,
        timeout_graceful_shutdown=5,  # connections left after the drain below
        # Fixed, not auto-detected: with httptools/uvloop installed (uvicorn[standard], or as
        # dependencies of other packages) uvicorn would switch parser and loop, and the
        # httptools parser answers some malformed headers with a bare 400 outside the app.
        http="h11",
        loop="asyncio",
    )
    server = DrainingServer(uv_config, engine, app.state.lifecycle, config.shutdown_timeout)
    engine.on_dead.append(server.engine_died)
    server.run()
    if engine.dead is not None:
        # The engine stopped for good (a device fault): a non-zero status makes Docker or
        # Kubernetes restart the server, which a zombie answering 503 would never get.
        sys.exit(1)


def _load(config: ServerConfig) -> LoadedModel | None:
    """The served model (rank 0's shard under tensor parallelism), its draft LoRA attached;
    None when a launcher started this process as a worker rank (it ran the worker's loop)."""
    mc = config.model
    loaded: LoadedModel | None = None
    try:
        # Whatever the size: a launcher's WORLD_SIZE with --tensor-parallel-size 1 (forgotten)
        # would otherwise have every rank load the whole model and open the API port.
        rank = multi_node_rank(mc.tensor_parallel_size)
        if mc.tensor_parallel_size > 1:
            size, ep = mc.tensor_parallel_size, mc.expert_parallel_size > 1
            if rank:  # a launcher started this process as a worker rank: no API here
                worker_main(
                    rank, size, "env://", mc.model, mc.device, mc.dtype, mc.draft_lora, 0, ep,
                    log=None,  # serve() set it up already
                )  # fmt: skip
                return None
            loaded = launch(
                mc.model,
                mc.device,
                mc.dtype,
                size,
                mc.draft_lora,
                expert_parallel=ep,
                log=(config.log_level, config.log_format),
            )
        else:
            loaded = load_model(mc.model, device=mc.device, dtype=mc.dtype)
        if mc.draft_lora is not None:
            attach_served_draft_lora(loaded, mc.draft_lora)
    except (ModelLoadError, UnsupportedModelError) as exc:
        # One line, no traceback; the model's name once (most messages already start with it).
        message = str(exc)
        if not message.startswith(f"model {mc.model!r}"):
            message = f"cannot load model {mc.model!r}: {message}"
        _exit_refused(loaded, f"dllm-serve: {message}")
    return loaded


def _exit_refused(loaded: LoadedModel | None, message: str) -> NoReturn:
    """Exit 1 with ``message``, stopping the tensor-parallel workers first: left to
    multiprocessing's exit handler, their end would be reported as a worker that died (a false
    CRITICAL after a start-up refusal)."""
    if loaded is not None and loaded.parallel is not None:
        loaded.parallel.stop(timeout=5)
    sys.exit(message)
