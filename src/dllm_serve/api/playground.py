"""The playground at ``/``, its trace stream and the offline ``/docs``.

- ``GET /``: a page (``static/playground.html``) where a prompt is typed, the request's
  settings picked, and the answer watched as it denoises: the canvas as cells, masked ones
  masked, each step's commits, tokens per forward and NFE; for self-speculative models each
  round's drafts and acceptances.
- ``POST /v1/dllm/trace``: the page's data. The body is a chat completion request (same
  fields, same validation, same 400s); the answer is an event stream, not the OpenAI one:
  ``start``, then one ``step`` (denoising) or ``round`` (self-speculation) event per forward
  (``engine/outputs.py``), ``delta`` events with the answer text as it becomes final, and
  ``done`` (content, finish_reason, usage) or ``error``. The chat stream itself is untouched.
- ``GET /v1/dllm/info``: the model's decoding mode and defaults, so the page offers only the
  settings that apply.
- ``GET /docs`` and ``GET /redoc``: Swagger UI and ReDoc from the files of the
  ``fastapi-offline`` package, served under ``/static/docs`` (FastAPI's defaults load them
  from a CDN and are blank on a node without internet access).

Everything these pages load is served by this server.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import fastapi_offline
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles
from sse_starlette import EventSourceResponse

from dllm_serve.api.completions import ChatSpec, Submit
from dllm_serve.api.errors import REQUEST_ID_HEADER
from dllm_serve.api.openapi_docs import GENERATION_ERRORS, error_responses, request_body
from dllm_serve.api.pipeline import ModelFacts
from dllm_serve.api.rules import renoise_info
from dllm_serve.api.streaming import failure, usage_dict
from dllm_serve.engine.engine import AsyncEngine
from dllm_serve.engine.outputs import RequestOutput

STATIC = Path(__file__).with_name("static")
# Swagger UI / ReDoc bundles, installed as a dependency rather than copied into this package.
DOCS_STATIC = Path(fastapi_offline.__file__).with_name("static")


def install_playground(
    app: FastAPI, engine: AsyncEngine, chat_spec: ChatSpec, submit: Submit, facts: ModelFacts
) -> None:
    # The more specific mount first: /static/docs would otherwise fall into /static.
    app.mount("/static/docs", StaticFiles(directory=DOCS_STATIC), name="docs-static")
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/", include_in_schema=False)
    async def playground() -> FileResponse:
        return FileResponse(STATIC / "playground.html", media_type="text/html")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title="dllm-serve API",
            swagger_js_url="/static/docs/swagger-ui-bundle.js",
            swagger_css_url="/static/docs/swagger-ui.css",
            swagger_favicon_url="/static/docs/favicon.png",
            # No validator badge: it would send the schema to validator.swagger.io.
            swagger_ui_parameters={"validatorUrl": None},
        )

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> HTMLResponse:
        page = get_redoc_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title="dllm-serve API",
            redoc_js_url="/static/docs/redoc.standalone.js",
            redoc_favicon_url="/static/docs/favicon.png",
            with_google_fonts=False,
        )
        # The ReDoc bundle draws its logo from cdn.redoc.ly; images from elsewhere than this
        # server are refused by the browser, so opening the page contacts no one else.
        page.headers["Content-Security-Policy"] = "img-src 'self' data: blob:"
        return page

    @app.get("/v1/dllm/info", tags=["dllm"], responses=error_responses(401))
    async def info() -> dict[str, Any]:
        """The served model's decoding mode and defaults (what the playground offers)."""
        return {
            "model": engine.model_name,
            "decoding_mode": engine.decoding_mode,
            # Tri-mode models: the mode of requests that name none (--decoding-mode).
            "default_decoding_mode": engine.default_decoding_mode,
            "default_max_tokens": engine.default_gen_length,
            # The block a request may name: a canvas model's recommended one, a block
            # model's trained one (the only one it accepts); none without denoising.
            "default_block_length": facts.default_block_length
            if engine.decoding_mode == "diffusion"
            else facts.block_size,
            "block_size": facts.block_size,
            "max_model_len": engine.max_length,
            # What a denoising request may choose (a tri-mode model's diffusion mode).
            "commit_rules": facts.decoding.commit_rules(),
            "diffusion_fields": facts.decoding.diffusion_fields(),
            # --decoding-algorithm: the rule of requests that choose none, as request fields.
            "decoding_algorithm": engine.decoding_algorithm,
            "default_commit_rule": engine.default_commit_rule,
            **renoise_info(facts.decoding),
        }

    @app.post(
        "/v1/dllm/trace",
        tags=["dllm"],
        openapi_extra=request_body("ChatCompletionRequest"),
        response_class=EventSourceResponse,
        responses={
            200: {"description": "the trace events", "content": {"text/event-stream": {}}},
            **error_responses(*GENERATION_ERRORS),
        },
    )
    async def trace(request: Request) -> EventSourceResponse:
        """A chat completion request answered as a per-step trace (docs/playground.md)."""
        spec, prompt_ids = await chat_spec(request, trace=True)
        request_id = request.state.request_id
        outputs = submit(request_id, spec, prompt_ids, spec.stop, trace=True)
        return EventSourceResponse(
            trace_events(outputs, spec.params.gen_length, len(prompt_ids)),
            headers={REQUEST_ID_HEADER: request_id},
        )


async def trace_events(
    outputs: AsyncGenerator[RequestOutput, None], canvas_length: int, prompt_tokens: int
) -> AsyncGenerator[dict[str, str], None]:
    """The engine's outputs as named server-sent events (see the module docstring). The
    ``start`` event also carries ``prompt_tokens``: a block-diffusion model's blocks are
    counted from the prompt's first token, so the page needs it to draw the answer's blocks."""
    parts: list[str] = []
    async with contextlib.aclosing(outputs):  # a closed stream aborts its request now
        async for output in outputs:
            for event in output.trace or ():
                data = (
                    event | {"prompt_tokens": prompt_tokens} if event["type"] == "start" else event
                )
                yield {"event": event["type"], "data": json.dumps(data)}
            if output.delta_text:
                parts.append(output.delta_text)
                yield {"event": "delta", "data": json.dumps({"content": output.delta_text})}
            if not output.finished:
                continue
            if output.finish_reason in ("stop", "length"):
                done = {
                    "content": "".join(parts),
                    "finish_reason": output.finish_reason,
                    "usage": usage_dict(output, canvas_length),
                }
                yield {"event": "done", "data": json.dumps(done)}
            else:
                status, message, err_type, code = failure(output)
                error = {"message": message, "type": err_type, "code": code, "status": status}
                yield {"event": "error", "data": json.dumps({"error": error})}
