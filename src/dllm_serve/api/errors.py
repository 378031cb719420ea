"""The OpenAI error envelope. Every error the server returns goes through here."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

REQUEST_ID_HEADER = "X-Request-ID"
CONTRACT_REF = "see docs/api-contract.md"


class APIError(Exception):
    """An error with an HTTP status and an OpenAI error body.

    ``param`` names the offending request field (``temperature``, ``messages[1].content``) so
    clients can point at it; ``code`` is a stable machine-readable reason or None.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(message, status=400, param=param, code=code)


def error_response(error: APIError, request_id: str | None) -> JSONResponse:
    headers = dict(error.headers)
    if request_id:
        headers[REQUEST_ID_HEADER] = request_id
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def server_error(
    message: str = "The server had an error while processing your request.",
) -> APIError:
    return APIError(message, status=500, type="server_error")
