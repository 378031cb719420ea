"""The generation routes: ``POST /v1/chat/completions`` and ``POST /v1/completions``.

Each reads and validates its body (``api/pipeline.py``), tokenizes the prompt off the event
loop, submits to the engine and answers as one JSON response or SSE chunks in its route's
shape. :func:`install_completion_routes` also hands the playground the chat validation and
the submission it shares.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from sse_starlette import EventSourceResponse

from dllm_serve.api.errors import REQUEST_ID_HEADER, APIError, unavailable
from dllm_serve.api.metrics import Metrics
from dllm_serve.api.middleware import Lifecycle
from dllm_serve.api.openapi_docs import GENERATION_ERRORS, error_responses, request_body
from dllm_serve.api.pipeline import ModelFacts, RequestSpec, chat_request, completion_request
from dllm_serve.api.protocol import ChatCompletionResponse, CompletionResponse
from dllm_serve.api.streaming import (
    Choices,
    chat_chunks,
    chat_logprobs,
    choices_usage,
    failure,
    merged,
    text_chunks,
    text_logprobs,
)
from dllm_serve.api.tools import parse_calls
from dllm_serve.config import ServerConfig
from dllm_serve.engine.engine import AsyncEngine, QueueFullError
from dllm_serve.engine.outputs import RequestOutput

# The routes were defined in api/app.py; their log lines keep that logger's name.
logger = logging.getLogger("dllm_serve.api.app")

# What the playground reuses: the chat validation (a request, whether to trace → spec and
# prompt ids) and the submission to the engine.
ChatSpec = Callable[[Request, bool], Awaitable[tuple[RequestSpec, list[int]]]]
Submit = Callable[..., AsyncGenerator[RequestOutput, None]]


def install_completion_routes(
    app: FastAPI,
    engine: AsyncEngine,
    config: ServerConfig,
    lifecycle: Lifecycle,
    metrics: Metrics,
) -> tuple[ChatSpec, Submit, ModelFacts]:
    """Add the two OpenAI generation routes; returns the chat validation, the submission and
    the model facts the playground reuses."""
    facts = ModelFacts(engine)

    @app.post(
        "/v1/chat/completions",
        tags=["openai"],
        response_model=ChatCompletionResponse,
        # Unset fields stay out: usage.diffusion carries the self-speculation counters only for
        # a self-speculative model, exactly as the streamed usage does.
        response_model_exclude_unset=True,
        openapi_extra=request_body("ChatCompletionRequest"),
        responses=error_responses(*GENERATION_ERRORS),
    )
    async def chat_completions(request: Request) -> Any:
        spec, prompt_ids = await chat_spec(request)
        return await run(request, spec, prompt_ids, "chat")

    async def chat_spec(request: Request, trace: bool = False) -> tuple[RequestSpec, list[int]]:
        """A chat request's validated spec and prompt ids (also the trace endpoint's, with
        ``trace``), from a worker thread: validating megabytes of messages or tokenizing a
        long prompt takes seconds, which on the event loop would stall every connection."""
        # The body is parsed by hand so every malformed input becomes a 400 in the OpenAI
        # envelope (FastAPI would answer 422, and some inputs would never reach pydantic).
        body, content_type = await request.body(), request.headers.get("content-type")
        return await asyncio.to_thread(chat_request, facts, body, content_type, trace)

    @app.post(
        "/v1/completions",
        tags=["openai"],
        response_model=CompletionResponse,
        response_model_exclude_unset=True,
        openapi_extra=request_body("CompletionRequest"),
        responses=error_responses(*GENERATION_ERRORS),
    )
    async def completions(request: Request) -> Any:
        body, content_type = await request.body(), request.headers.get("content-type")
        spec, prompt_ids = await asyncio.to_thread(completion_request, facts, body, content_type)
        return await run(request, spec, prompt_ids, "text")

    async def run(request: Request, spec: RequestSpec, prompt_ids: list[int], kind: str) -> Any:
        """Submit to the engine and answer as JSON or SSE in the route's shape."""
        request_id = request.state.request_id
        response_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{request_id}"
        created = int(time.time())
        # A JSON answer is read whole: the engine decodes it once, at the end (unless it
        # matches stop strings, which it does step by step).
        streams = submit_choices(request_id, spec, prompt_ids, final_only=not spec.stream)
        if spec.params.grammar is not None:
            metrics.structured.inc()
        if spec.stream:
            chunks = (chat_chunks if kind == "chat" else text_chunks)(
                merged(streams),
                response_id=response_id,
                created=created,
                model=engine.model_name,
                canvas_length=spec.params.gen_length,
                include_usage=spec.include_usage,
                continuous_usage=spec.continuous_usage,
                prompt_tokens=len(prompt_ids),
                speculative=facts.decoding.self_speculative(spec.params.decoding_mode),
                n=spec.n,
                **({"tools": spec.tools} if kind == "chat" else {}),
            )
            return EventSourceResponse(chunks, headers={REQUEST_ID_HEADER: request_id})
        answers = await _collect_unless_disconnected(request, merged(streams), spec.n)
        if answers is None:  # the client went away; its requests were aborted
            return Response(status_code=499)
        choices = []
        for index, (text, last, entries) in enumerate(answers):
            reason = last.finish_reason
            if kind == "chat":
                message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
                if spec.tools is not None:
                    content, calls = parse_calls(text, spec.tools)
                    if calls:
                        message |= {"content": content, "tool_calls": calls}
                        reason = "tool_calls" if reason == "stop" else reason
                choice: dict[str, Any] = {
                    "index": index,
                    "message": message,
                    "logprobs": chat_logprobs(entries),
                }
            else:
                choice = {"index": index, "text": text, "logprobs": text_logprobs(entries)}
            choices.append(choice | {"finish_reason": reason})
        return {
            "id": response_id,
            "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": created,
            "model": engine.model_name,
            "choices": choices,
            "usage": choices_usage([last for _, last, _ in answers], spec.params.gen_length),
            "system_fingerprint": None,
        }

    def submit_choices(
        request_id: str, spec: RequestSpec, prompt_ids: list[int], *, final_only: bool
    ) -> list[AsyncGenerator[RequestOutput, None]]:
        """Submit every choice of ``spec`` together (one step admits them all); all or none:
        a full queue part-way aborts those already submitted and is a 429."""
        if spec.n == 1:
            return [
                submit(request_id, spec, prompt_ids, spec.stop, final_only=final_only,
                       include_stop=spec.include_stop_str)
            ]  # fmt: skip
        streams: list[AsyncGenerator[RequestOutput, None]] = []
        ids: list[str] = []
        try:
            with engine.submitting_together():
                for params in spec.choice_params():
                    ids.append(lifecycle.engine_request_id(request_id))
                    streams.append(
                        submit(request_id, replace(spec, params=params, n=1), prompt_ids,
                               spec.stop, final_only=final_only,
                               include_stop=spec.include_stop_str, engine_id=ids[-1])
                    )  # fmt: skip
        except APIError:
            for engine_id in ids[: len(streams)]:
                engine.abort(engine_id)
            raise
        return streams

    def submit(
        request_id: str,
        spec: RequestSpec,
        prompt_ids: list[int],
        stop: tuple[str, ...],
        trace: bool = False,
        final_only: bool = False,
        include_stop: bool = False,
        engine_id: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Hand a request to the engine; a full queue is a 429 before any response starts.

        With --log-requests the request is logged here and its answer when it ends, whichever
        route sent it and however it is answered (JSON, SSE, the trace endpoint).
        """
        if lifecycle.draining:  # drain began while this request was being read
            raise unavailable("The server is shutting down.", "server_shutting_down")
        if config.log_requests:
            # Everything that shapes the answer: the request can be replayed from the log.
            extra = (f" stop={spec.stop!r}" if spec.stop else "") + _info(spec)
            if spec.messages is not None:
                logger.info("messages=%r params=%r%s", spec.messages, spec.params, extra)
            else:
                logger.info("prompt=%r params=%r%s", spec.prompt, spec.params, extra)
        try:
            outputs = engine.generate(
                prompt_ids,
                spec.params,
                request_id=engine_id or lifecycle.engine_request_id(request_id),
                stop=stop,
                timeout=config.request_timeout,
                trace=trace,
                final_only=final_only,
                include_stop=include_stop,
            )
        except QueueFullError as exc:
            metrics.rejected.labels("queue_full").inc()
            logger.info("rejected: status=429 code=rate_limit_exceeded (%s)", exc)
            raise APIError(
                f"The server is at capacity ({exc}); retry shortly.",
                status=429,
                type="rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": "1"},
            ) from None
        return _logging_answer(outputs) if config.log_requests else outputs

    return chat_spec, submit, facts


async def _logging_answer(
    outputs: AsyncGenerator[RequestOutput, None],
) -> AsyncGenerator[RequestOutput, None]:
    """The engine's outputs unchanged; the whole answer is logged when its last one arrives."""
    parts: list[str] = []
    finished = False
    try:
        async with contextlib.aclosing(outputs):  # closed early: its request is aborted now
            async for output in outputs:
                parts.append(output.delta_text)
                if output.finished:
                    finished = True
                    logger.info("answer=%r finish_reason=%s", "".join(parts), output.finish_reason)
                yield output
    finally:
        if not finished:
            logger.info("answer=%r finish_reason=None (the response ended first)", "".join(parts))


async def _collect_unless_disconnected(
    request: Request, outputs: Choices, n: int
) -> list[tuple[str, RequestOutput, list | None]] | None:
    """Every choice's answer, last output and logprob entries (None when not asked for), or
    None if the client disconnected first (its requests are then aborted). A choice that
    failed raises its error (the others abort)."""

    async def collect() -> list[tuple[str, RequestOutput, list | None]]:
        parts: list[list[str]] = [[] for _ in range(n)]
        entries: list[list | None] = [None] * n
        last: dict[int, RequestOutput] = {}
        async with contextlib.aclosing(outputs):
            async for index, output in outputs:
                parts[index].append(output.delta_text)
                if output.logprobs is not None:
                    entries[index] = [*(entries[index] or []), *output.logprobs]
                last[index] = output
                if output.finished and output.finish_reason not in ("stop", "length"):
                    status, message, err_type, code = failure(output)
                    raise APIError(message, status=status, type=err_type, code=code)
        return [("".join(parts[i]), last[i], entries[i]) for i in range(n)]

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
    return work.result() if not work.cancelled() else None


def _info(spec: RequestSpec) -> str:
    """Informational fields (user, metadata, ...) for --log-requests."""
    return "".join(f" {name}={value!r}" for name, value in spec.info.items())
