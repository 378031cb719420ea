"""Property-based fuzzing of POST /v1/chat/completions and /v1/completions from the server's own
OpenAPI schema.

schemathesis turns ``ChatCompletionRequest`` and ``CompletionRequest`` (registered in
/openapi.json) into hypothesis
strategies: schema-conforming bodies (positive) and schema-violating ones, including non-JSON
bytes (negative). Every answer must be a 2xx or a 4xx in the OpenAI envelope, never a 5xx
other than the server's own documented 504 deadline, always with X-Request-ID, and within the
client timeout (no hang).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rel_support import CHAT, assert_envelope, wait_idle
from remote_server import RemoteServer
from schemathesis import GenerationMode

MAX_EXAMPLES = 150
COMPLETIONS = "/v1/completions"
# (route, request schema, examples): the chat route is the main one; completions shares its rules.
ROUTES = [(CHAT, "ChatCompletionRequest", MAX_EXAMPLES), (COMPLETIONS, "CompletionRequest", 60)]
CLIENT_TIMEOUT_S = 30


@pytest.fixture(scope="module")
def fuzz_server(rel_server: RemoteServer) -> Iterator[RemoteServer]:
    yield rel_server
    assert "unhandled error" not in rel_server.log.read_text()  # nothing reached the 500 handler


def body_strategy(url: str, route: str = CHAT, schema: str = "ChatCompletionRequest") -> Any:
    raw = httpx.get(f"{url}/openapi.json", timeout=10).json()
    assert schema in raw["components"]["schemas"]
    operation = schemathesis.openapi.from_dict(raw)[route]["POST"]
    return st.one_of(
        operation.as_strategy(generation_mode=GenerationMode.POSITIVE),
        operation.as_strategy(generation_mode=GenerationMode.NEGATIVE),
    )


def encode(body: Any) -> bytes:
    if isinstance(body, bytes):
        return body
    return json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")


@pytest.mark.parametrize(("route", "schema", "examples"), ROUTES, ids=["chat", "completions"])
def test_fuzzed_bodies_never_5xx_or_hang(
    fuzz_server: RemoteServer, route: str, schema: str, examples: int
) -> None:
    outcomes: dict[int, int] = {}
    with httpx.Client(base_url=fuzz_server.url, timeout=CLIENT_TIMEOUT_S) as http:

        @given(case=body_strategy(fuzz_server.url, route, schema))
        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def check(case: Any) -> None:
            body = encode(case.body) if case.body is not schemathesis.core.NOT_SET else b""
            media = case.media_type or "application/json"
            response = http.post(route, content=body, headers={"Content-Type": media})
            outcomes[response.status_code] = outcomes.get(response.status_code, 0) + 1
            assert response.headers.get("x-request-id"), body[:300]
            if response.status_code == 504:
                assert assert_envelope(response, body[:300])["code"] == "request_timeout"
                return
            assert response.status_code < 500, (response.status_code, response.text, body[:300])
            if response.status_code >= 300:
                assert_envelope(response, body[:300])
            elif "text/event-stream" not in response.headers["content-type"]:
                assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")

        check()
    print("fuzz outcomes by status:", outcomes)
    assert sum(outcomes.values()) >= examples // 2, outcomes
    assert outcomes.get(400, 0) > 0, outcomes  # the fuzzer really reached validation
    wait_idle(fuzz_server.url)
