"""/openapi.json describes what the server does (found by schemathesis: no route listed its
400s, /v1/models/{id} listed a 422 the server never sends, /health claimed a JSON body, the
trace endpoint had no request body)."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from dllm_serve.api.app import build_app
from dllm_serve.engine.engine import AsyncEngine
from dllm_serve.models.loader import load_model

ENVELOPE = {"$ref": "#/components/schemas/ErrorResponse"}


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    app = build_app(AsyncEngine(load_model("tiny-llada", device="cpu")))
    with TestClient(app) as client:
        return client.get("/openapi.json").json()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/dllm/trace"])
def test_generation_routes_list_their_errors_and_body(schema: dict[str, Any], path: str) -> None:
    operation = schema["paths"][path]["post"]
    assert set(operation["responses"]) == {"200", "400", "401", "413", "429", "500", "503", "504"}
    for status in ("400", "429", "504"):
        assert operation["responses"][status]["content"]["application/json"]["schema"] == ENVELOPE
    body = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert body.endswith("CompletionRequest")


def test_no_route_promises_a_422(schema: dict[str, Any]) -> None:
    for operations in schema["paths"].values():
        for operation in operations.values():
            assert "422" not in operation["responses"]
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    model = schema["paths"]["/v1/models/{model_id}"]["get"]["responses"]
    assert set(model) == {"200", "401", "404"}


def test_health_has_no_body(schema: dict[str, Any]) -> None:
    responses = schema["paths"]["/health"]["get"]["responses"]
    assert set(responses) == {"200", "503"}
    assert "content" not in responses["200"]
    error = schema["components"]["schemas"]["ErrorDetail"]
    assert set(error["required"]) == {"message", "type", "param", "code"}


def test_every_v1_route_lists_the_api_key_401(schema: dict[str, Any]) -> None:
    """``--api-key`` guards every /v1 path (found by QA: /v1/dllm/info did not list its 401)."""
    for path, operations in schema["paths"].items():
        if path.startswith("/v1/"):
            for method, operation in operations.items():
                assert "401" in operation["responses"], (method, path)


def test_every_request_body_has_an_example_that_names_the_served_model(
    schema: dict[str, Any],
) -> None:
    """Swagger UI's "Try it out" starts from the first example (else a body of nulls, a 400);
    tests/integration/test_docs_examples.py sends them all to a real server."""
    question = [{"role": "user", "content": "What is 2 + 2?"}]
    bodies = {
        path: operation["requestBody"]["content"]["application/json"]["examples"]
        for path, operations in schema["paths"].items()
        for operation in operations.values()
        if "requestBody" in operation
    }
    assert set(bodies) == {"/v1/chat/completions", "/v1/completions", "/v1/dllm/trace"}
    chat = {"model": "tiny-llada", "messages": question}
    assert bodies["/v1/dllm/trace"] == {
        "what_is_2_plus_2": {"summary": "What is 2 + 2?", "value": chat}
    }
    assert bodies["/v1/chat/completions"]["what_is_2_plus_2"]["value"] == chat
    assert bodies["/v1/chat/completions"]["streamed"]["value"] == chat | {
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    # No chat template on /v1/completions: the example writes the question in tiny-llada's.
    prompt = bodies["/v1/completions"]["what_is_2_plus_2"]["value"]["prompt"]
    assert prompt == (
        "<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2 + 2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
