"""Every failure as an OpenAI error envelope: the app's exception handlers, 400 accounting.

Each 400 is counted in ``dllm:requests_rejected_total{reason}`` and logged with its param and
code; FastAPI's own 404/405/422 become envelopes too (never a bare 422), an engine that died is
a 503, and anything unexpected a 500 with the traceback in the log, never in the response.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from dllm_serve.api.errors import REQUEST_ID_HEADER, APIError, server_error, unavailable
from dllm_serve.engine.engine import EngineDeadError

logger = logging.getLogger("dllm_serve.api.app")


def error_response(error: APIError, request_id: str | None) -> JSONResponse:
    headers = dict(error.headers)
    if request_id:
        headers[REQUEST_ID_HEADER] = request_id
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    def rid(request: Request) -> str | None:
        return getattr(request.state, "request_id", None)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        if exc.status == 400:
            record_rejection(app, exc, request.url.path)
        return error_response(exc, rid(request))

    @app.exception_handler(EngineDeadError)
    async def on_engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(unavailable(), rid(request))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        method = getattr(request.state, "method", request.method)  # HEAD is routed as GET
        message = f"{exc.detail}: {method} {request.url.path}"
        # Starlette's own headers stay: a 405 names the allowed methods in Allow (HEAD as
        # well wherever GET is allowed, as HeadAsGet answers it).
        headers = dict(exc.headers or {})
        allow = headers.get("Allow", "").split(", ")
        if "GET" in allow and "HEAD" not in allow:
            headers["Allow"] = ", ".join([*allow, "HEAD"])
        err = APIError(message, status=exc.status_code, code=code, headers=headers)
        return error_response(err, rid(request))

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = APIError(f"Invalid request: {exc.errors()[0]['msg']}")
        record_rejection(app, error, request.url.path)
        return error_response(error, rid(request))

    @app.exception_handler(ClientDisconnect)
    async def on_client_gone(request: Request, exc: ClientDisconnect) -> Response:
        # The client left while its body was being read: nothing to answer, nothing failed.
        logger.info("client disconnected before sending the whole request body")
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(server_error(), rid(request))


def record_rejection(app: FastAPI, error: APIError, path: str) -> None:
    """Every 400: ``dllm:requests_rejected_total{reason=<code>}`` and one log line naming the
    param and code (never the request body; the message only with --log-requests)."""
    reason = error.code or "invalid_request"
    app.state.metrics.rejected.labels(reason).inc()
    if app.state.config.log_requests:
        logger.info(
            "rejected %s: status=%d param=%s code=%s message=%r",
            path, error.status, error.param, reason, error.message,
        )  # fmt: skip
    else:
        logger.info(
            "rejected %s: status=%d param=%s code=%s", path, error.status, error.param, reason
        )
