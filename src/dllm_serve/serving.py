"""Serve a :class:`ServerConfig`: port → model (or tensor-parallel group) → engine → uvicorn.

The port is bound first, so a port already in use (or an address that is not this machine's)
is refused in a second, not after minutes of loading an 8B checkpoint; the bound sockets are
handed to uvicorn, which starts listening on them once the engine is ready (until then
connections are refused, as before). Start-up refusals (a busy port, a model that does not
load, flags it does not take) are one line on stderr and exit status 1, with any
tensor-parallel workers stopped first.

The start-up log says what the server took: how long loading and building the engine took,
the draft LoRA attached, the KV pool's size (GiB and tokens, and why that size), and the URL
of the playground.
"""

from __future__ import annotations

import errno
import logging
import socket
import sys
import time
from typing import NoReturn

import uvicorn

from dllm_serve.api.app import build_app
from dllm_serve.api.server import DrainingServer
from dllm_serve.config import ServerConfig
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.engine.engine import AsyncEngine
from dllm_serve.engine.model_runner import CPU_DEFAULT_KV_GIB
from dllm_serve.engine.parallel.rendezvous import multi_node_rank
from dllm_serve.engine.workers import launch, worker_main
from dllm_serve.logs import configure_logging
from dllm_serve.models.families import UnsupportedModelError
from dllm_serve.models.loader import LoadedModel, ModelLoadError, load_model
from dllm_serve.models.lora import attach_served_draft_lora

logger = logging.getLogger("dllm_serve")
_GIB = 1 << 30


class PortUnavailableError(Exception):
    """The port cannot be bound; the message is the one line the command prints."""


def serve(config: ServerConfig) -> None:
    started = time.monotonic()
    log_config = configure_logging(config.log_level, config.log_format)
    mc = config.model
    try:
        # Whatever the size: a launcher's WORLD_SIZE with --tensor-parallel-size 1 (forgotten)
        # would otherwise have every rank load the whole model and open the API port.
        rank = multi_node_rank(mc.tensor_parallel_size)
    except ModelLoadError as exc:
        _exit_refused(None, f"dllm-serve: {exc}")
    if rank:  # a launcher started this process as a worker rank: no API port, no engine
        _run_worker_rank(config, rank)
        return
    try:
        sockets = bind_port(config.host, config.port)
    except PortUnavailableError as exc:
        _exit_refused(None, str(exc))
    loaded = _load(config)
    built = time.monotonic()
    try:
        engine = AsyncEngine(loaded, config.engine)
    except ValueError as exc:  # e.g. a --decoding-mode the model does not have
        _exit_refused(loaded, f"dllm-serve: {exc}")
    logger.info("%s", describe_kv_pool(engine, loaded))
    logger.info("engine ready in %.1f s%s", time.monotonic() - built, _graph_note(engine))
    url = base_url(config.host, sockets[0].getsockname()[1])
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

    def ready() -> None:
        # Once uvicorn listens (it logs no address for sockets it is handed), and so after
        # every refusal: "serving" is never followed by a start-up error.
        logger.info(
            "serving %s on %s: playground %s/ · API %s/v1 · docs %s/docs (ready %.1f s after "
            "start)",
            loaded.name,
            _listening(config.host, sockets),
            url,
            url,
            url,
            time.monotonic() - started,
        )

    server = DrainingServer(
        uv_config, engine, app.state.lifecycle, config.shutdown_timeout, on_started=ready
    )
    engine.on_dead.append(server.engine_died)
    try:
        # Two servers started together can both bind (SO_REUSEADDR) while neither listens;
        # only one of them can listen.
        for sock in sockets:
            sock.listen(uv_config.backlog)
    except OSError as exc:
        _exit_refused(loaded, _bind_refusal(config.host, config.port, exc))
    server.run(sockets=sockets)
    if engine.dead is not None:
        # The engine stopped for good (a device fault): a non-zero status makes Docker or
        # Kubernetes restart the server, which a zombie answering 503 would never get.
        sys.exit(1)


def bind_port(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to every address ``host`` resolves to, at ``port`` (``0``: one free port
    for all of them), as uvicorn would bind them itself: ``SO_REUSEADDR`` (a restart is not
    refused for the previous run's closing connections), IPv6 sockets IPv6-only. They do not
    listen yet; raises :class:`PortUnavailableError` with the command's one-line message."""
    try:
        infos = socket.getaddrinfo(
            host, port, socket.AF_UNSPEC, socket.SOCK_STREAM, socket.IPPROTO_TCP,
            socket.AI_PASSIVE,
        )  # fmt: skip
    except socket.gaierror as exc:
        raise PortUnavailableError(
            f"dllm-serve: --host {host!r} is not an address or a known host name ({exc.strerror})"
        ) from None
    sockets: list[socket.socket] = []
    seen: set[tuple[int, str]] = set()
    try:
        for family, kind, proto, _, address in infos:
            if (family, address[0]) in seen:
                continue
            seen.add((family, address[0]))
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if sockets[:1] != [sock]:  # port 0: the others take the port the first one got
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            try:
                sock.bind(address)
            except OSError as exc:
                raise PortUnavailableError(_bind_refusal(host, port, exc)) from None
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _bind_refusal(host: str, port: int, exc: OSError) -> str:
    where = f"port {port} on {host}"
    if exc.errno == errno.EADDRINUSE:
        return (
            f"dllm-serve: {where} is in use (another dllm-serve, or another server, listens "
            "there); stop it or choose another --port"
        )
    if exc.errno == errno.EACCES:
        return (
            f"dllm-serve: no permission to bind {where} (ports below 1024 need privileges); "
            "choose another --port"
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return (
            f"dllm-serve: cannot bind {where}: {host} is not an address of this machine "
            "(--host 127.0.0.1: this machine only; 0.0.0.0: all interfaces)"
        )
    return f"dllm-serve: cannot bind {where}: {exc.strerror or exc}"


def base_url(host: str, port: int) -> str:
    """The URL to open for a server bound to ``host``: a wildcard address is reached on this
    machine through the loopback address; IPv6 addresses in brackets."""
    shown = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    if ":" in shown:
        shown = f"[{shown}]"
    return f"http://{shown}:{port}"


def _listening(host: str, sockets: list[socket.socket]) -> str:
    """Where the server listens: the bound addresses, wildcards named as such."""
    port = sockets[0].getsockname()[1]
    if host in ("0.0.0.0", "::"):
        return f"{host}:{port} (all interfaces)"
    addresses = [s.getsockname()[0] for s in sockets]
    shown = ", ".join(f"[{a}]" if ":" in a else a for a in addresses)
    return f"{shown} port {port}" if len(addresses) > 1 else f"{shown}:{port}"


def describe_kv_pool(engine: AsyncEngine, loaded: LoadedModel) -> str:
    """What the KV pool took and why that much: ``--kv-cache-memory`` (or its default) is a
    ceiling, and the pool never takes more than the running requests can use."""
    pool = engine.runner.pool
    config = engine.config
    if pool is None:
        hint = ""
        if engine.decoding_mode == "diffusion" and config.kv_cache == "none":
            hint = " (LLaDA and Dream keep one with --kv-cache prefix)"
        return f"no KV pool: {loaded.name}'s decoding keeps no K/V{hint}"
    per_rank = " per rank" if loaded.parallel is not None else ""
    size = (
        f"KV pool: {pool.nbytes / _GIB:.3g} GiB, {pool.slots:,} tokens in {pool.num_pages:,} "
        f"pages of {pool.page_size}{per_rank}"
    )
    if config.kv_cache_memory is not None:
        asked = f"--kv-cache-memory asked for {config.kv_cache_memory:g} GiB"
    elif loaded.device.type == "cuda":
        asked = "default: 90% of the GPU memory free after the weights, minus 1 GiB"
    else:
        asked = f"default on CPU: {CPU_DEFAULT_KV_GIB:g} GiB"
    # The same worst case as the engine's sizing (engine/scheduler.py pool_slots): the longest
    # context in whole pages, for every running request.
    longest = engine.algorithm.kv_tokens(loaded.max_length - 1, DecodingParams(gen_length=1))
    longest = pool.pages_for(longest) * pool.page_size
    running = config.max_running_requests
    if pool.slots == running * longest:
        return (
            f"{size} ({asked}; capped at what --max-running-requests {running} requests of the "
            f"longest context, {longest:,} tokens each, can use)"
        )
    return f"{size} ({asked})"


def _graph_note(engine: AsyncEngine) -> str:
    """CUDA graphs are captured lazily, on the first step of each shape: start-up has no
    capture time to report, and the first request of a shape pays it."""
    if engine.runner.graphs is None or not engine.runner.graphs.capture:
        return ""
    return " (CUDA graphs: each decode shape is captured on its first step)"


def _run_worker_rank(config: ServerConfig, rank: int) -> None:
    """This process's share of a launcher-started tensor-parallel group (rank > 0)."""
    mc = config.model
    ep = mc.expert_parallel_size > 1
    try:
        worker_main(
            rank, mc.tensor_parallel_size, "env://", mc.model, mc.device, mc.dtype,
            mc.draft_lora, 0, ep, log=None,  # serve() set it up already
        )  # fmt: skip
    except (ModelLoadError, UnsupportedModelError) as exc:
        _exit_refused(None, f"dllm-serve: {exc}")


def _load(config: ServerConfig) -> LoadedModel:
    """The served model (rank 0's shard under tensor parallelism), its draft LoRA attached."""
    mc = config.model
    loaded: LoadedModel | None = None
    started = time.monotonic()
    try:
        if mc.tensor_parallel_size > 1:
            loaded = launch(
                mc.model,
                mc.device,
                mc.dtype,
                mc.tensor_parallel_size,
                mc.draft_lora,
                expert_parallel=mc.expert_parallel_size > 1,
                log=(config.log_level, config.log_format),
            )
        else:
            loaded = load_model(mc.model, device=mc.device, dtype=mc.dtype)
        logger.info(
            "loaded %s in %.1f s (%s, %s)",
            loaded.name,
            time.monotonic() - started,
            loaded.device,
            loaded.dtype,
        )
        if mc.draft_lora is not None:
            layers = attach_served_draft_lora(loaded, mc.draft_lora)
            logger.info(
                "draft LoRA %s: o_proj of %d layer(s) adapted, used by LinearSpec's draft "
                "forwards only",
                mc.draft_lora,
                layers,
            )
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
