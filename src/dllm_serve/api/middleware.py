"""Pure ASGI middleware: request ids, API key, body-size limit, draining gate.

Pure ASGI (not BaseHTTPMiddleware) so they also cover streamed responses and never buffer.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Callable

import uuid6
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dllm_serve.api.error_handlers import error_response
from dllm_serve.api.errors import REQUEST_ID_HEADER, APIError, invalid
from dllm_serve.logs import request_id_var

# Visible ASCII only: the id is echoed in a header and written into logs.
_VALID_ID = re.compile(r"[\x21-\x7e]{1,256}")


def new_request_id() -> str:
    return str(uuid6.uuid7())


class RequestIdMiddleware:
    """Pure ASGI, so it also covers streamed responses and errors raised below it.

    The id is stored in ``scope["state"]["request_id"]`` (``request.state.request_id``) for the
    handlers, and exception handlers that run outside this middleware add the header themselves.
    """

    def __init__(
        self, app: ASGIApp, on_reject: Callable[[APIError, str], None] | None = None
    ) -> None:
        self.app = app
        self.on_reject = on_reject  # told of the 400 for an invalid X-Request-ID

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        values = Headers(scope=scope).getlist("x-request-id")
        sent = values[0] if len(values) == 1 else None
        request_id = sent if sent and _VALID_ID.fullmatch(sent) else new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id
        request_id_var.set(request_id)
        if values and sent != request_id:
            # Two ids for one request would make either choice a silent guess.
            message = (
                f"Invalid {REQUEST_ID_HEADER} header: use 1 to 256 visible ASCII characters."
                if sent is not None
                else f"{REQUEST_ID_HEADER} was sent {len(values)} times: send it once."
            )
            error = invalid(message, code="invalid_request_id")
            if self.on_reject is not None:
                self.on_reject(error, scope.get("path", ""))
            await error_response(error, request_id)(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                if REQUEST_ID_HEADER.lower() not in headers:
                    headers.append(REQUEST_ID_HEADER, request_id)
            await send(message)

        await self.app(scope, receive, send_with_id)


def _request_id(scope: Scope) -> str | None:
    return scope.get("state", {}).get("request_id")


# Operations endpoints that stay open while draining, for scrapers; /health turns 503 instead,
# so probes take the pod out of rotation. (Outside /v1 they never need the API key.)
OPEN_WHILE_DRAINING = ("/metrics", "/version")


class ApiKeyMiddleware:
    """``Authorization: Bearer <key>`` on the API routes; probes, metrics and docs stay open.

    The comparison is constant-time over SHA-256 digests, so neither the key's content nor its
    length leaks through timing.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._digest = hashlib.sha256(api_key.encode()).digest()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1"):
            await self.app(scope, receive, send)
            return
        auth = Headers(scope=scope).get("authorization", "")
        scheme, _, token = auth.partition(" ")
        given = hashlib.sha256(token.strip().encode()).digest()
        if scheme.lower() != "bearer" or not hmac.compare_digest(given, self._digest):
            # "Incorrect" only when a key was sent: a request with none (the playground's first,
            # before a key is typed) is told that none was given.
            what = "Incorrect API key provided" if auth.strip() else "No API key provided"
            error = APIError(
                f"{what}. Send it as 'Authorization: Bearer <key>'.",
                status=401,
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            await error_response(error, _request_id(scope))(scope, receive, send)
            return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for bodies over ``max_bytes``: by Content-Length up front, else while streaming in."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _error(self) -> APIError:
        return APIError(
            f"Request body too large: the limit is {self.max_bytes} bytes.",
            status=413,
            code="request_too_large",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await error_response(self._error(), _request_id(scope))(scope, receive, send)
            return
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise self._error()  # turned into the 413 envelope by the app's handler
            return message

        await self.app(scope, counting_receive, send)


class DrainGate:
    """While the server drains for shutdown: 503 for new API requests and for /health.

    Readiness probes fail, so load balancers stop routing here; /metrics and /version stay up.
    """

    def __init__(self, app: ASGIApp, is_draining: Callable[[], bool]) -> None:
        self.app = app
        self.is_draining = is_draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and self.is_draining() and path not in OPEN_WHILE_DRAINING:
            error = APIError(
                "The server is shutting down; retry on another replica.",
                status=503,
                type="service_unavailable_error",
                code="server_shutting_down",
                headers={"Connection": "close", "Retry-After": "1"},
            )
            await error_response(error, _request_id(scope))(scope, receive, send)
            return
        await self.app(scope, receive, send)


class HeadAsGet:
    """HEAD wherever GET is (RFC 9110 §9.3.2): a HEAD request is routed as a GET, and the
    body of the answer is dropped while its status and headers (Content-Length included) go
    out as they are. FastAPI routes answer only the methods they list, and listing HEAD on
    each route would give every GET two OpenAPI operations with one id. The method the
    client sent stays in ``scope["state"]["method"]`` for error messages."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return
        scope = dict(scope, method="GET")
        scope.setdefault("state", {})["method"] = "HEAD"

        async def headers_only(message: Message) -> None:
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return  # a streamed body: only its end is sent, empty
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        await self.app(scope, receive, headers_only)


class Lifecycle:
    """Server-wide state the routes and middleware share (draining for shutdown)."""

    def __init__(self) -> None:
        self.draining = False
        self._counter = 0

    def engine_request_id(self, request_id: str) -> str:
        # Clients may reuse an X-Request-ID; the engine id must stay unique (abort is by id).
        self._counter += 1
        return f"{request_id}#{self._counter}"
