"""build_app(engine) → the FastAPI application (OpenAI-compatible routes)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette import EventSourceResponse

from dllm_serve import __version__
from dllm_serve.api.deviations import DEVIATIONS_TABLE
from dllm_serve.api.error_handlers import install_error_handlers, record_rejection, unavailable
from dllm_serve.api.errors import (
    REQUEST_ID_HEADER,
    APIError,
    invalid,
)
from dllm_serve.api.metrics import Metrics
from dllm_serve.api.middleware import (
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    DrainGate,
    RequestIdMiddleware,
)
from dllm_serve.api.playground import install_playground
from dllm_serve.api.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from dllm_serve.api.stops import keep_stop_strings
from dllm_serve.api.streaming import chat_chunks, failure, text_chunks, usage_dict
from dllm_serve.api.validation import (
    RequestSpec,
    check_context_length,
    check_token_ids,
    parse_chat_request,
    parse_completion_request,
)
from dllm_serve.config import ServerConfig
from dllm_serve.engine.engine import AsyncEngine, QueueFullError
from dllm_serve.engine.outputs import RequestOutput

logger = logging.getLogger(__name__)

DESCRIPTION = f"""OpenAI-compatible server for diffusion LLMs.

## Diffusion vs OpenAI semantics

The full contract, with the reason for each rule, is docs/api-contract.md in the repository.

{DEVIATIONS_TABLE}"""


class Lifecycle:
    """Server-wide state the routes and middleware share (draining for shutdown)."""

    def __init__(self) -> None:
        self.draining = False
        self._counter = 0

    def engine_request_id(self, request_id: str) -> str:
        # Clients may reuse an X-Request-ID; the engine id must stay unique (abort is by id).
        self._counter += 1
        return f"{request_id}#{self._counter}"


def build_app(engine: AsyncEngine, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    lifecycle = Lifecycle()

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
    )
    app.state.engine = engine
    app.state.config = config
    app.state.lifecycle = lifecycle
    metrics = Metrics(
        lambda: engine.num_running, lambda: engine.num_waiting, lambda: engine.kv_cache_bytes
    )
    engine.observer = metrics
    app.state.metrics = metrics
    app.state.started = int(time.time())
    # Added innermost first: RequestId → DrainGate → ApiKey → BodyLimit → routes.
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes)
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    if config.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.cors_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type", "X-Request-ID"],
            expose_headers=["X-Request-ID"],
        )
    app.add_middleware(DrainGate, is_draining=lambda: lifecycle.draining)
    app.add_middleware(
        RequestIdMiddleware, on_reject=lambda error, path: record_rejection(app, error, path)
    )
    install_error_handlers(app)

    # HEAD too: probes and uptime checkers may use it (RFC 9110: HEAD wherever GET is).
    @app.api_route("/health", methods=["GET", "HEAD"], tags=["ops"])
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

    @app.get("/v1/models", response_model=ModelList, tags=["openai"])
    async def list_models() -> ModelList:
        return ModelList(data=[model_card()])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, tags=["openai"])
    async def retrieve_model(model_id: str) -> ModelCard:
        if model_id != engine.model_name:
            raise APIError(
                f"The model '{model_id}' does not exist. This server serves '{engine.model_name}'.",
                status=404,
                param="model",
                code="model_not_found",
            )
        return model_card()

    facts = _ModelFacts(engine)

    @app.post(
        "/v1/chat/completions",
        tags=["openai"],
        response_model=ChatCompletionResponse,
        # Unset fields stay out: usage.diffusion carries the self-speculation counters only for
        # a self-speculative model, exactly as the streamed usage does.
        response_model_exclude_unset=True,
        openapi_extra=_request_body("ChatCompletionRequest"),
    )
    async def chat_completions(request: Request) -> Any:
        spec, prompt_ids = await chat_spec(request)
        if config.log_requests:
            logger.info("messages=%r params=%r%s", spec.messages, spec.params, _info(spec))
        return await run(request, spec, prompt_ids, "chat")

    async def chat_spec(request: Request) -> tuple[RequestSpec, list[int]]:
        """A chat request's validated spec and prompt ids (also the trace endpoint's)."""
        # The body is parsed by hand so every malformed input becomes a 400 in the OpenAI
        # envelope (FastAPI would answer 422, and some inputs would never reach pydantic).
        spec = parse_chat_request(
            await request.body(),
            request.headers.get("content-type"),
            engine.default_gen_length,
            facts.default_block_length,
        )
        spec.check_decoding_mode(engine.decoding_mode, facts.block_size, facts.default_mode)
        facts.check_stop_token_ids(spec)
        if not engine.is_alive:
            raise unavailable()
        assert spec.messages is not None
        prompt_ids = await asyncio.to_thread(engine.chat_prompt_ids, spec.messages)
        check_context_length(len(prompt_ids), spec.params.gen_length, engine.max_length)
        return spec, prompt_ids

    @app.post(
        "/v1/completions",
        tags=["openai"],
        response_model=CompletionResponse,
        response_model_exclude_unset=True,
        openapi_extra=_request_body("CompletionRequest"),
    )
    async def completions(request: Request) -> Any:
        spec = parse_completion_request(
            await request.body(),
            request.headers.get("content-type"),
            engine.default_gen_length,
            facts.default_block_length,
        )
        spec.check_decoding_mode(engine.decoding_mode, facts.block_size, facts.default_mode)
        facts.check_stop_token_ids(spec)
        if not engine.is_alive:
            raise unavailable()
        if isinstance(spec.prompt, str):
            prompt_ids = await asyncio.to_thread(engine.prompt_ids, spec.prompt)
        else:
            assert spec.prompt is not None
            check_token_ids(spec.prompt, facts.vocab_size, facts.mask_id, "prompt")
            prompt_ids = spec.prompt
        if not prompt_ids:
            raise invalid("'prompt' is empty: it must hold at least one token.", "prompt")
        check_context_length(len(prompt_ids), spec.params.gen_length, engine.max_length, "prompt")
        if config.log_requests:
            logger.info("prompt=%r params=%r%s", spec.prompt, spec.params, _info(spec))
        return await run(request, spec, prompt_ids, "text")

    async def run(request: Request, spec: RequestSpec, prompt_ids: list[int], kind: str) -> Any:
        """Submit to the engine and answer as JSON or SSE in the route's shape."""
        request_id = request.state.request_id
        response_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{request_id}"
        created = int(time.time())
        # include_stop_str_in_output: stop strings are matched here instead of in the engine.
        keep_stops = spec.include_stop_str and bool(spec.stop)
        outputs = submit(request_id, spec, prompt_ids, () if keep_stops else spec.stop)
        if keep_stops:
            outputs = keep_stop_strings(outputs, spec.stop)
        if spec.stream:
            chunks = (chat_chunks if kind == "chat" else text_chunks)(
                outputs,
                response_id=response_id,
                created=created,
                model=engine.model_name,
                canvas_length=spec.params.gen_length,
                include_usage=spec.include_usage,
                continuous_usage=spec.continuous_usage,
                prompt_tokens=len(prompt_ids),
            )
            return EventSourceResponse(chunks, headers={REQUEST_ID_HEADER: request_id})
        text, last = await _collect_unless_disconnected(request, outputs)
        if last is None:  # the client went away; its request was aborted
            return Response(status_code=499)
        if config.log_requests:
            logger.info("answer=%r finish_reason=%s", text, last.finish_reason)
        if last.finish_reason not in ("stop", "length"):
            status, message, err_type, code = failure(last)
            raise APIError(message, status=status, type=err_type, code=code)
        if kind == "chat":
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None},
            }
        else:
            choice = {"index": 0, "text": text}
        choice |= {"logprobs": None, "finish_reason": last.finish_reason}
        return {
            "id": response_id,
            "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": created,
            "model": engine.model_name,
            "choices": [choice],
            "usage": usage_dict(last, spec.params.gen_length),
            "system_fingerprint": None,
        }

    def submit(
        request_id: str,
        spec: RequestSpec,
        prompt_ids: list[int],
        stop: tuple[str, ...],
        trace: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Hand a request to the engine; a full queue is a 429 before any response starts."""
        if lifecycle.draining:  # drain began while this request was being read
            raise unavailable("The server is shutting down.", "server_shutting_down")
        try:
            return engine.generate(
                prompt_ids,
                spec.params,
                request_id=lifecycle.engine_request_id(request_id),
                stop=stop,
                timeout=config.request_timeout,
                trace=trace,
            )
        except QueueFullError as exc:
            metrics.rejected.labels("queue_full").inc()
            raise APIError(
                f"The server is at capacity ({exc}); retry shortly.",
                status=429,
                type="rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": "1"},
            ) from None

    install_playground(app, engine, chat_spec, submit, facts)
    _register_request_schema(app)
    return app


async def _collect_unless_disconnected(
    request: Request, outputs: AsyncIterator[RequestOutput]
) -> tuple[str, RequestOutput | None]:
    """Collect the answer; if the client disconnects first, abort the request."""

    async def collect() -> tuple[str, RequestOutput | None]:
        parts, last = [], None
        async for output in outputs:
            parts.append(output.delta_text)
            last = output
        return "".join(parts), last

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(collect())
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()  # raises inside engine.generate(), whose finally aborts the request
            await asyncio.gather(work, return_exceptions=True)
    return work.result() if not work.cancelled() else ("", None)


class _ModelFacts:
    """What the API layer reads from the loaded model: block, vocabulary, mask id, tokenizer."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        loaded = getattr(engine, "loaded", None)
        self.default_block_length: int | None = getattr(loaded, "default_block_length", None)
        self.vocab_size: int = getattr(loaded, "vocab_size", 0) or 0
        self.mask_id: int | None = getattr(loaded, "mask_id", None)
        self.block_size: int | None = getattr(loaded, "block_size", None)
        # The decoding_mode of requests that name none (tri-mode models: --decoding-mode).
        self.default_mode: str | None = getattr(engine, "default_decoding_mode", None)

    def check_stop_token_ids(self, spec: RequestSpec) -> None:
        if spec.params.stop_token_ids:
            check_token_ids(
                spec.params.stop_token_ids, self.vocab_size, self.mask_id, "stop_token_ids"
            )


def _info(spec: RequestSpec) -> str:
    """Informational fields (user, metadata, ...) for --log-requests."""
    return "".join(f" {name}={value!r}" for name, value in spec.info.items())


def _request_body(schema: str) -> dict[str, Any]:
    ref = {"$ref": f"#/components/schemas/{schema}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _register_request_schema(app: FastAPI) -> None:
    """Publish the request models in /openapi.json (the routes parse the bodies themselves)."""
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
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
