"""The OpenAI error envelope. Every error the server returns goes through here (free of the
web framework: the offline ``LLM`` raises the same errors; ``error_handlers.py`` answers them)."""

from __future__ import annotations

from typing import Any

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


def server_error(
    message: str = "The server had an error while processing your request.",
) -> APIError:
    return APIError(message, status=500, type="server_error")


def unavailable(message: str = "The engine is not running.", code: str = "engine_dead") -> APIError:
    return APIError(message, status=503, type="service_unavailable_error", code=code)
