"""Logging: every line carries the request id it concerns (or "-"), as text or JSON.

The HTTP layer sets :data:`request_id_var` for the task serving a request; the engine thread,
which serves many requests, passes ``extra={"request_id": ...}`` explicitly.
"""

from __future__ import annotations

import contextvars
import json
import logging
import time
import unicodedata

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")

TEXT_FORMAT = "%(asctime)s %(levelname)s [%(request_id)s] %(name)s: %(message)s"


class RequestIdFilter(logging.Filter):
    """Adds ``record.request_id`` from the context when the call did not pass one."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "request_id", None):
            record.request_id = request_id_var.get()
        return True


def escape_controls(text: str) -> str:
    """``text`` with every control, format or line-separating character (line breaks, tabs,
    ESC, U+2028, ...) written as its Python escape, so a value a client sent (a URL path, a
    field name) cannot start a forged log line or drive a terminal; spaces such as U+00A0
    stay as they are."""
    if text.isprintable():
        return text
    return "".join(
        ch if ch.isprintable() or unicodedata.category(ch) == "Zs" else repr(ch)[1:-1]
        for ch in text
    )


class TextFormatter(logging.Formatter):
    """The text format with :func:`escape_controls` applied to the message (one line per
    record; a traceback still follows on its own lines)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape_controls(record.message)
        return super().formatMessage(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, request_id, message (+ exc_info)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "request_id": getattr(record, "request_id", "-"),
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(level: str = "info", fmt: str = "text") -> dict:
    """Configure the root logger, and return a uvicorn ``log_config`` that uses it too."""
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # uvicorn's loggers propagate to the root handler instead of installing their own.
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "loggers": {
            name: {"handlers": [], "propagate": True, "level": level.upper()}
            for name in ("uvicorn", "uvicorn.error", "uvicorn.access")
        },
    }
