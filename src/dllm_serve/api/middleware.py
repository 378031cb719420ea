"""X-Request-ID: honoured when sent, else a UUIDv7; echoed on every response."""

from __future__ import annotations

import re

import uuid6
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dllm_serve.api.errors import REQUEST_ID_HEADER, error_response, invalid

# Visible ASCII only: the id is echoed in a header and written into logs.
_VALID_ID = re.compile(r"[\x21-\x7e]{1,256}")


def new_request_id() -> str:
    return str(uuid6.uuid7())


class RequestIdMiddleware:
    """Pure ASGI, so it also covers streamed responses and errors raised below it.

    The id is stored in ``scope["state"]["request_id"]`` (``request.state.request_id``) for the
    handlers, and exception handlers that run outside this middleware add the header themselves.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = Headers(scope=scope).get("x-request-id")
        request_id = sent if sent and _VALID_ID.fullmatch(sent) else new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id
        if sent is not None and sent != request_id:
            error = invalid(
                f"Invalid {REQUEST_ID_HEADER} header: use 1 to 256 visible ASCII characters.",
                code="invalid_request_id",
            )
            await error_response(error, request_id)(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                if REQUEST_ID_HEADER.lower() not in headers:
                    headers.append(REQUEST_ID_HEADER, request_id)
            await send(message)

        await self.app(scope, receive, send_with_id)
