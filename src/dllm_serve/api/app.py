"""build_app(engine) → the FastAPI application (OpenAI-compatible routes).

Here: the middleware, the ops routes and ``/v1/models``; the generation routes are in
``api/completions.py``, the playground and ``/docs`` in ``api/playground.py``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dllm_serve.api.completions import install_completion_routes
from dllm_serve.api.deviations import DEVIATIONS_TABLE
from dllm_serve.api.error_handlers import install_error_handlers, record_rejection
from dllm_serve.api.errors import APIError
from dllm_serve.api.metrics import Metrics
from dllm_serve.api.middleware import (
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    DrainGate,
    HeadAsGet,
    Lifecycle,
    RequestIdMiddleware,
)
from dllm_serve.api.openapi_docs import (
    EXAMPLE_MESSAGES,
    EXAMPLE_QUESTION,
    error_responses,
    request_examples,
    with_request_examples,
    without_validation_errors,
)
from dllm_serve.api.playground import install_playground
from dllm_serve.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from dllm_serve.config import ServerConfig
from dllm_serve.engine.engine import AsyncEngine
from dllm_serve.version import __version__

DESCRIPTION = f"""OpenAI-compatible server for diffusion LLMs.

## Diffusion vs OpenAI semantics

The full contract, with the reason for each rule, is docs/api-contract.md in the repository.

{DEVIATIONS_TABLE}"""


def build_app(engine: AsyncEngine, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    lifecycle = Lifecycle()

    def rank_failed() -> bool:
        # Tensor parallelism: a rank died and the process exits in a moment (status 1,
        # engine/parallel/group.py); until then /health and new requests answer 503.
        group = engine.loaded.parallel
        return group is not None and group.failure is not None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not engine.is_alive:
            engine.start()
        yield
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(
        title="dllm-serve",
        version=__version__,
        description=DESCRIPTION,
        lifespan=lifespan,
        # /docs and /redoc are served by api/playground.py from locally installed files (the
        # defaults load them from a CDN and are blank offline).
        docs_url=None,
        redoc_url=None,
        # No 307 from /v1/chat/completions/ to /v1/chat/completions: a path that is not a
        # route is a 404 with an error body, trailing slash or not.
        redirect_slashes=False,
    )
    app.state.engine = engine
    app.state.config = config
    app.state.lifecycle = lifecycle
    metrics = Metrics(
        lambda: engine.num_running,
        lambda: engine.num_waiting,
        lambda: engine.kv_cache_bytes,
        lambda: engine.kv_pages,
        lambda: engine.prefix_cache_pages,
    )
    engine.observer = metrics
    app.state.metrics = metrics
    app.state.started = int(time.time())
    # Added innermost first: CORS → RequestId → DrainGate → ApiKey → BodyLimit → HeadAsGet →
    # routes.
    app.add_middleware(HeadAsGet)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes)
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    app.add_middleware(DrainGate, is_draining=lambda: lifecycle.draining or rank_failed())
    app.add_middleware(
        RequestIdMiddleware, on_reject=lambda error, path: record_rejection(app, error, path)
    )
    if config.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        # Outermost, so every answer a browser gets carries the CORS headers (the draining
        # 503 and a bad X-Request-ID's 400 included), and any request header is allowed: the
        # openai JS SDK sends its own (x-stainless-*, openai-organization, ...), as does
        # every SDK built on it, and the origin list is what restricts access.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.cors_origins),
            allow_methods=["GET", "HEAD", "POST", "OPTIONS"],
            allow_headers=["*"],
            expose_headers=["X-Request-ID"],
        )
    install_error_handlers(app)

    # HEAD is answered wherever GET is (HeadAsGet): probes and uptime checkers use it.
    @app.get(
        "/health",
        tags=["ops"],
        response_class=Response,  # an empty body, no content type
        responses={200: {"description": "serving"}, 503: {"description": "not serving"}},
    )
    async def health() -> Response:
        return Response(status_code=200 if engine.is_alive else 503)

    @app.get("/metrics", tags=["ops"], response_class=PlainTextResponse)
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version", tags=["ops"])
    async def version() -> dict[str, str]:
        return {"version": __version__}

    def model_card() -> ModelCard:
        return ModelCard(
            id=engine.model_name, created=app.state.started, max_model_len=engine.max_length
        )

    @app.get(
        "/v1/models", response_model=ModelList, tags=["openai"], responses=error_responses(401)
    )
    async def list_models() -> ModelList:
        return ModelList(data=[model_card()])

    @app.get(
        "/v1/models/{model_id:path}",
        response_model=ModelCard,
        tags=["openai"],
        responses=error_responses(401, 404),
    )
    async def retrieve_model(model_id: str) -> ModelCard:
        if model_id != engine.model_name:
            raise APIError(
                f"The model '{model_id}' does not exist. This server serves '{engine.model_name}'.",
                status=404,
                param="model",
                code="model_not_found",
            )
        return model_card()

    chat_spec, submit, facts = install_completion_routes(app, engine, config, lifecycle, metrics)
    install_playground(app, engine, chat_spec, submit, facts)
    examples = request_examples(engine.model_name, _raw_example_prompt(engine))
    _register_request_schema(app, examples)
    return app


def _raw_example_prompt(engine: AsyncEngine) -> str:
    """The completions example's prompt: the example question in the served model's chat
    template (a model trained on chat answers it as it answers the chat example), else the
    bare question. Rendered here, once, before the server takes requests."""
    tokenizer = engine.loaded.tokenizer
    if getattr(tokenizer, "chat_template", None):
        try:
            return str(
                tokenizer.apply_chat_template(
                    EXAMPLE_MESSAGES, tokenize=False, add_generation_prompt=True
                )
            )
        except Exception:  # any template error: the bare question still gets a 200
            pass
    return EXAMPLE_QUESTION


def _register_request_schema(app: FastAPI, examples: dict[str, dict[str, Any]]) -> None:
    """Publish the request models in /openapi.json (the routes parse the bodies themselves),
    each request body with its examples."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = build()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in (ChatCompletionRequest, CompletionRequest):
            defs = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(defs.pop("$defs", {}))
            components[model.__name__] = defs
        return with_request_examples(without_validation_errors(schema), examples)

    app.openapi = openapi  # type: ignore[method-assign]
