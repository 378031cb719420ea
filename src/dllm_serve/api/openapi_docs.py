"""What /openapi.json says about the routes that FastAPI cannot infer: the error envelope every
route answers with, and the request bodies the routes parse by hand (schemathesis found the
schema listing neither, and a 422 the server never sends)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

# Why each status is sent (docs/api.md, "Errors").
_WHEN = {
    400: "invalid request: the field at fault in `param`, a stable reason in `code`",
    401: "missing or wrong API key (`--api-key`)",
    404: "no such model",
    413: "request body larger than `--max-request-bytes`",
    429: "waiting queue full; retry after `Retry-After` seconds",
    500: "internal error",
    503: "engine stopped, or the server is shutting down",
    504: "request took longer than `--request-timeout`",
}
GENERATION_ERRORS = (400, 401, 413, 429, 500, 503, 504)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error envelope, which every error of this server uses."""

    error: ErrorDetail


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a route answering ``statuses`` with the error envelope."""
    return {s: {"model": ErrorResponse, "description": _WHEN[s]} for s in statuses}


def request_body(schema: str) -> dict[str, Any]:
    """``openapi_extra=`` naming the request model a route parses from its raw body."""
    ref = {"$ref": f"#/components/schemas/{schema}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


# The question every example asks: the demo models answer it ("2 + 2 = 4"), any model answers
# it with a 200.
EXAMPLE_QUESTION = "What is 2 + 2?"
EXAMPLE_MESSAGES = [{"role": "user", "content": EXAMPLE_QUESTION}]


def request_examples(model: str, raw_prompt: str) -> dict[str, dict[str, Any]]:
    """The example request bodies of each route, as OpenAPI ``examples`` maps: what /docs'
    "Try it out" starts from (without them, Swagger UI generates ``null`` for every field,
    which the server refuses). ``raw_prompt`` is the completions example's prompt."""
    chat = {"model": model, "messages": EXAMPLE_MESSAGES}
    plain = {"what_is_2_plus_2": {"summary": EXAMPLE_QUESTION, "value": chat}}
    if raw_prompt != EXAMPLE_QUESTION:
        raw_note = (
            "/v1/completions applies no chat template: this prompt is the question already "
            "written in the served model's chat template (what a chat request sends it)."
        )
    else:
        raw_note = "/v1/completions applies no chat template: the prompt is sent as is."
    return {
        "/v1/chat/completions": plain
        | {
            "streamed": {
                "summary": f"{EXAMPLE_QUESTION} streamed, with the usage at the end",
                "value": chat | {"stream": True, "stream_options": {"include_usage": True}},
            },
        },
        "/v1/completions": {
            "what_is_2_plus_2": {
                "summary": f"{EXAMPLE_QUESTION} as a raw prompt",
                "description": raw_note,
                "value": {"model": model, "prompt": raw_prompt},
            },
        },
        # The trace always streams: it refuses "stream" and "stream_options".
        "/v1/dllm/trace": plain,
    }


def with_request_examples(
    schema: dict[str, Any], examples: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """Each route of ``examples`` gets its examples on its JSON request body."""
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            media = operation.get("requestBody", {}).get("content", {}).get("application/json")
            if media is not None and path in examples:
                media["examples"] = examples[path]
    return schema


def without_validation_errors(schema: dict[str, Any]) -> dict[str, Any]:
    """Drop FastAPI's automatic 422 answers: every malformed input here is a 400 in the
    envelope, never a 422."""
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
    components = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    return schema
