"""Hand-written hostile inputs against a real server: every one is answered, none with a 5xx.

Each non-2xx answer carries the OpenAI envelope and an X-Request-ID (docs/api-contract.md);
the server keeps serving afterwards (the shared `rel_server`). Bounds: a 512 KiB body limit,
canvases of 4-40 tokens, 30 s client timeout per request, 120 fuzzed examples.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rel_support import CHAT, REL_BODY_LIMIT, assert_envelope, sse_events, wait_idle
from remote_server import RemoteServer

from dllm_serve.api.protocol import ChatCompletionRequest, ChatMessage, StreamOptions

LIMIT = REL_BODY_LIMIT
BASE: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def srv(rel_server: RemoteServer) -> Iterator[RemoteServer]:
    yield rel_server
    assert "unhandled error" not in rel_server.log.read_text()  # nothing reached the 500 handler


@pytest.fixture(scope="module")
def http(srv: RemoteServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, timeout=30) as client:
        yield client


def post(http: httpx.Client, body: bytes | dict[str, Any], **headers: str) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = http.post(CHAT, content=content, headers={**JSON, **headers})
    assert response.status_code < 500, (response.status_code, response.text, content[:200])
    assert response.headers.get("x-request-id"), content[:200]
    if response.status_code != 200:
        assert_envelope(response, content[:200])
    return response


def rejected(response: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, (response.status_code, response.text)
    return response.json()["error"]


def answered(response: httpx.Response) -> None:
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")


# ---- size ----------------------------------------------------------------------------------
def padded(size: int) -> bytes:
    """A valid request padded with JSON whitespace to exactly ``size`` bytes."""
    body = json.dumps(BASE).encode()
    return body + b" " * (size - len(body))


def test_body_at_the_limit_is_served_one_byte_over_is_413(http: httpx.Client) -> None:
    answered(post(http, padded(LIMIT)))
    assert rejected(post(http, padded(LIMIT + 1)), 413)["code"] == "request_too_large"
    huge = padded(8 * LIMIT)

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit is enforced while reading
        for i in range(0, len(huge), 64 * 1024):
            yield huge[i : i + 64 * 1024]

    response = http.post(CHAT, content=chunks(), headers=JSON)
    assert rejected(response, 413)["code"] == "request_too_large"
    assert_envelope(response)


def test_lying_content_length_over_the_limit_is_413_without_reading(srv: RemoteServer) -> None:
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {10**12}\r\nConnection: close\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
        sock.sendall(head.encode() + b"{")
        reply = sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b"x-request-id" in reply.lower()


def test_ten_thousand_messages(http: httpx.Client) -> None:
    started = time.monotonic()
    body = {"messages": [{"role": "user", "content": "hi"}] * 10_000, "max_tokens": 4}
    error = rejected(post(http, body))
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert time.monotonic() - started < 15
    many_empty = {"messages": [{"role": "user", "content": ""}] * 10_000, "max_tokens": 4}
    assert post(http, many_empty).status_code in (200, 400)


# ---- encoding ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "raw",
    [
        b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}',
        b'{"messages": [{"role": "user", "content": "\xc0\xaf"}]}',  # overlong '/'
        b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}',  # encoded surrogate
        b'{"messages": [{"role": "user", "content": "ab\xe2\x82"}]}',  # truncated sequence
        b'{"\xff": 1, "messages": []}',
        b"\xff\xfe{\x00}\x00",  # UTF-16 with a BOM
    ],
)
def test_invalid_utf8_is_400(http: httpx.Client, raw: bytes) -> None:
    assert rejected(post(http, raw))["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("escaped", "ok"),
    [
        ("\\ud800", False),  # lone high surrogate
        ("\\udfff", False),  # lone low surrogate
        ("\\udc00\\ud800", False),  # pair in the wrong order
        ("\\ud83d\\ude00", True),  # a valid pair: U+1F600
        ("\\u0000", True),  # NUL, escaped: legal JSON
    ],
)
@pytest.mark.parametrize("field", ["content", "model", "user", "stop"])
def test_escaped_surrogates_and_nul(http: httpx.Client, escaped: str, ok: bool, field: str) -> None:
    text = f'"a{escaped}b"'
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    raw = json.dumps(body)
    at = '"x"' if field == "content" else '"max_tokens": 4'
    raw = raw.replace(at, text if field == "content" else f'{at}, "{field}": {text}')
    response = post(http, raw.encode())
    if ok:
        answered(response)
    else:
        assert "JSON" in rejected(response)["message"]  # refused by the parser, not later


def test_raw_nul_and_control_bytes_in_json_are_400(http: httpx.Client) -> None:
    for byte in (0, 1, 8, 0x1B, 0x1F):
        raw = b'{"messages": [{"role": "user", "content": "a' + bytes([byte]) + b'b"}]}'
        rejected(post(http, raw))
    rejected(post(http, b"\x00" * 64))


def test_escaped_control_characters_in_content_are_served(http: httpx.Client) -> None:
    content = "".join(chr(c) for c in range(32)) + "\x7f\u2028\u2029\ufeff\U0010ffff"
    for stream in (False, True):
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4}
        response = post(http, {**body, "stream": stream})
        assert response.status_code == 200, response.text
        if stream:
            events = sse_events(response.text.splitlines())
            assert events[-1] == {"done": True} and not any("error" in e for e in events)


# ---- structure -----------------------------------------------------------------------------
@pytest.mark.parametrize("depth", [50, 1_000, 50_000])
def test_deeply_nested_json(http: httpx.Client, depth: int) -> None:
    nested_list = b"[" * depth + b"]" * depth
    nested_obj = b'{"a":' * depth + b"1" + b"}" * depth
    for raw in (
        b'{"messages": [{"role": "user", "content": ' + nested_list + b"}]}",
        b'{"messages": [{"role": "user", "content": "x"}], "response_format": ' + nested_obj + b"}",
        b'{"messages": [{"role": "user", "content": "x"}], "tools": [' + nested_list + b"]}",
        nested_list,
    ):
        rejected(post(http, raw))


def test_duplicate_keys_last_one_wins(http: httpx.Client) -> None:
    head = b'{"messages": [{"role": "user", "content": "hi"}], '
    answered(post(http, head + b'"max_tokens": "x", "max_tokens": 4}'))
    assert rejected(post(http, head + b'"max_tokens": 4, "max_tokens": "x"}'))["param"] == (
        "max_tokens"
    )
    dup_role = b'{"messages": [{"role": "user", "role": "function", "content": "hi"}]}'
    assert rejected(post(http, dup_role))["param"] == "messages[0].role"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"", None),
        (b'""', None),
        (b"{}", "messages"),
        (b"[]", None),
        (b"null", None),
        (b'{"messages": []}', "messages"),
        (b'{"messages": [{}]}', "messages[0].role"),
        (b'{"messages": [{"role": ""}]}', "messages[0].role"),
        (b'{"messages": [{"role": "user", "content": ""}], "stop": ""}', "stop"),
        (b'{"messages": [{"role": "user", "content": ""}], "stop": [""]}', "stop[0]"),
        (b'{"messages": [{"role": "user", "content": ""}], "": 1}', ""),
    ],
)
def test_empty_values(http: httpx.Client, body: bytes, param: str | None) -> None:
    assert rejected(post(http, body))["param"] == (param or None)


def test_empty_strings_where_text_is_free_are_served(http: httpx.Client) -> None:
    answered(post(http, {**BASE, "messages": [{"role": "user", "content": ""}]}))
    answered(post(http, {**BASE, "model": "", "user": ""}))
    answered(post(http, {**BASE, "messages": [{"role": "user", "content": []}]}))


# ---- headers -------------------------------------------------------------------------------
def test_non_ascii_bytes_in_other_headers_are_ignored(http: httpx.Client) -> None:
    junk = b"\x80\xff caf\xe9"
    answered(http.post(CHAT, json=BASE, headers={"X-Junk": junk}))  # type: ignore[dict-item]


def raw_exchange(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return reply


def raw_post(port: int, header: bytes) -> tuple[int, dict[str, str], bytes]:
    """POST BASE with one raw header line; (status, lower-cased headers, body)."""
    body = json.dumps(BASE).encode()
    request = (
        f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
        + header
        + f"\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )
    reply = raw_exchange(port, request)
    head, _, payload = reply.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, payload


@pytest.mark.parametrize(
    "value",
    [b"", b" ", b"a b", b"a\tb", b"\x7f", b"x" * 257, b"caf\xe9", b"\xff\xfe"],
)
def test_invalid_request_id_header_is_400_with_a_fresh_id(srv: RemoteServer, value: bytes) -> None:
    status, headers, payload = raw_post(srv.port, b"X-Request-ID: " + value)
    assert status == 400, payload
    error = json.loads(payload)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "invalid_request_id"
    fresh = headers["x-request-id"]
    assert fresh and fresh.encode("latin-1") != value.strip()


def test_a_repeated_request_id_header_is_400(srv: RemoteServer) -> None:
    """Two X-Request-ID headers (even equal ones) are refused rather than one picked."""
    for pair in (b"X-Request-ID: one\r\nX-Request-ID: two", b"X-Request-ID: a\r\nX-Request-ID: a"):
        status, headers, payload = raw_post(srv.port, pair)
        assert status == 400, payload
        error = json.loads(payload)["error"]
        assert error["code"] == "invalid_request_id"
        assert error["message"] == "X-Request-ID was sent 2 times: send it once."
        assert headers["x-request-id"] not in ("one", "two", "a")


@pytest.mark.parametrize("header", [b"X-Request-ID: a\x01b", b"X-Junk: a\x00b", b"X-Junk: a\rb"])
def test_control_characters_in_headers(srv: RemoteServer, header: bytes) -> None:
    """A NUL or CR in a header value is refused by the HTTP parser (h11, inside uvicorn)
    before the app runs, a plain 400 without the envelope; other control bytes reach the app,
    which refuses them in X-Request-ID with its JSON 400. Either way: a 400, and the server
    keeps serving.
    """
    status, _, payload = raw_post(srv.port, header)
    assert status == 400, payload
    assert httpx.post(f"{srv.url}{CHAT}", json=BASE, timeout=30).status_code == 200


@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]
)
def test_wrong_content_type_is_400(http: httpx.Client, content_type: str | None) -> None:
    headers = {"Content-Type": content_type} if content_type else {}
    response = http.post(CHAT, content=json.dumps(BASE).encode(), headers=headers)
    assert response.status_code == 400
    assert assert_envelope(response)["code"] == "unsupported_media_type"


# ---- wrong types for every field -----------------------------------------------------------
SAMPLES: dict[str, Any] = {
    "string": "x",
    "integer": 3,
    "number": 0.5,
    "boolean": True,
    "array": [1],
    "object": {"k": 1},
    "null": None,
}


def json_types(schema: dict[str, Any], defs: dict[str, Any]) -> set[str] | None:
    """The JSON types a property schema admits; None when any value is (``Any``)."""
    if "$ref" in schema:
        return json_types(defs[schema["$ref"].rsplit("/", 1)[1]], defs)
    if "anyOf" in schema:
        kinds: set[str] = set()
        for option in schema["anyOf"]:
            sub = json_types(option, defs)
            if sub is None:
                return None
            kinds |= sub
        return kinds
    if "enum" in schema or "const" in schema:
        return {"string"}
    kind = schema.get("type")
    if kind is None:
        return None
    kinds = {kind} if isinstance(kind, str) else set(kind)
    return kinds | {"integer"} if "number" in kinds else kinds


def field_cases() -> list[tuple[str, Any, bool]]:
    """(dotted field, wrong value, schema-typed?) for every field of the request models."""
    schema = ChatCompletionRequest.model_json_schema()
    defs = schema.get("$defs", {})
    models = {
        "": schema,
        "messages[0].": defs["ChatMessage"],
        "stream_options.": defs["StreamOptions"],
    }
    cases = []
    for prefix, model in models.items():
        for name, prop in model["properties"].items():
            allowed = json_types(prop, defs)
            for kind, value in SAMPLES.items():
                if allowed is None or kind not in allowed:
                    cases.append((prefix + name, value, allowed is not None))
    return cases


def with_field(path: str, value: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    if path.startswith("messages[0]."):
        body["messages"][0][path.split(".", 1)[1]] = value
    elif path.startswith("stream_options."):
        body["stream"] = True
        body["stream_options"] = {path.split(".", 1)[1]: value}
    else:
        body[path] = value
    return body


def test_every_field_of_the_request_model_is_covered() -> None:
    paths = {path for path, _, _ in field_cases()}
    expected = (
        set(ChatCompletionRequest.model_fields)
        | {f"messages[0].{name}" for name in ChatMessage.model_fields}
        | {f"stream_options.{name}" for name in StreamOptions.model_fields}
    )
    assert {"messages[0].refusal", "stream_options.continuous_usage_stats"} <= expected
    assert paths == expected


@pytest.mark.parametrize(("path", "value", "typed"), field_cases())
def test_wrong_type_for_every_field(http: httpx.Client, path: str, value: Any, typed: bool) -> None:
    response = post(http, with_field(path, value))
    if typed:  # pydantic's type check: always a 400 naming the field
        error = rejected(response)
        assert error["param"] is not None and error["param"].startswith(path), error
    elif response.status_code == 400:  # free-form fields, checked in validation.py
        param = response.json()["error"]["param"]
        assert param is None or param.startswith(path.split(".")[0].split("[")[0]), param


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("messages[0].content", 3),
        ("messages[0].content", {"k": 1}),
        ("messages[0].content", [1]),
        ("stop", 3),
        ("stop", [1]),
        ("stop", ["a", "b", "c", "d", "e"]),
        ("tool_choice", "auto"),
        ("function_call", {"name": "f"}),
        ("tools", [{"type": "function"}]),
    ],
)
def test_free_form_fields_reject_wrong_shapes(http: httpx.Client, path: str, value: Any) -> None:
    error = rejected(post(http, with_field(path, value)))
    assert error["param"] is not None and error["param"].startswith(path), error


# ---- the semantic rules, fuzzed with small canvases ---------------------------------------
SMALL_INT = st.one_of(st.none(), st.integers(min_value=-2, max_value=40))
UNIT = st.one_of(st.none(), st.floats(min_value=-0.5, max_value=1.5, allow_nan=False))
EXTENSIONS = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": SMALL_INT,
        "max_completion_tokens": SMALL_INT,
        "target_length": SMALL_INT,
        "block_length": SMALL_INT,
        "num_denoising_steps": SMALL_INT,
        "temperature": st.one_of(st.none(), st.floats(-1, 3, allow_nan=False)),
        "seed": st.one_of(st.none(), st.integers(-(2**64), 2**65)),
        "top_k": SMALL_INT,
        "top_p": UNIT,
        "n": SMALL_INT,
        "stream": st.one_of(st.none(), st.booleans()),
        "stream_options": st.one_of(
            st.none(), st.fixed_dictionaries({}, optional={"include_usage": st.booleans()})
        ),
        "stop": st.one_of(st.none(), st.text(max_size=3), st.lists(st.text(max_size=3))),
        "block_schedule": st.sampled_from([None, "uniform", "cosine", "front_loaded", "x"]),
        "confidence_metric": st.sampled_from([None, "top1_prob", "entropy_inverse"]),
        "confidence_threshold": UNIT,
        "use_local_leap": st.one_of(st.none(), st.booleans()),
        "local_leap_anchor_threshold": UNIT,
        "local_leap_neighbor_threshold": UNIT,
        "local_leap_radius": SMALL_INT,
        "entropy_bound": st.one_of(st.none(), st.floats(-1, 20, allow_nan=False)),
        "entropy_threshold": st.one_of(st.none(), st.floats(-1, 20, allow_nan=False)),
        "edit_threshold": UNIT,
        "max_post_edit_steps": SMALL_INT,
        "force_single_batch": st.one_of(st.none(), st.booleans()),
        "attention_backend": st.sampled_from([None, "sdpa", "fa2"]),
        "response_format": st.sampled_from([None, {"type": "text"}, {"type": "json_object"}]),
    },
)


def test_fuzzed_decoding_options_are_answered_or_rejected_with_a_param(
    srv: RemoteServer, http: httpx.Client
) -> None:
    seen: dict[int, int] = {}

    @given(options=EXTENSIONS, content=st.text(max_size=20))
    @settings(
        max_examples=120, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    def check(options: dict[str, Any], content: str) -> None:
        body = {"messages": [{"role": "user", "content": content}], **options}
        if all(body.get(k) is None for k in ("max_tokens", "target_length")):
            body["max_tokens"] = 8  # keep every accepted request small
        response = post(http, body)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        if response.status_code != 200:
            assert response.status_code == 400, response.text
            return
        if body.get("stream"):
            events = sse_events(response.text.splitlines())
            assert events[0]["choices"][0]["delta"]["role"] == "assistant"
            assert events[-1] == {"done": True}
            assert not any("error" in e for e in events), events
        else:
            answered(response)

    check()
    assert seen.get(200, 0) > 0 and seen.get(400, 0) > 0, seen
    wait_idle(srv.url)


# ---- routes and methods --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", CHAT, 405),
        ("PUT", CHAT, 405),
        ("DELETE", "/v1/models", 405),
        ("OPTIONS", CHAT, 405),  # CORS is off unless configured
        ("POST", "/health", 405),
        ("GET", "/nope", 404),
        ("TRACE", "/", 405),  # / is the playground page (GET and HEAD only)
        ("GET", "/v1/chat/completions/../models", 404),
        # A trailing slash is another path: a 404 in the envelope, not a bare 307 redirect.
        ("POST", f"{CHAT}/", 404),
        ("GET", "/v1/models/", 404),
        ("GET", "/health/", 404),
    ],
)
def test_wrong_routes_and_methods_get_the_envelope(
    http: httpx.Client, method: str, path: str, status: int
) -> None:
    response = http.request(method, path)
    assert response.status_code == status
    assert_envelope(response)


def test_head_on_health_answers_like_get(http: httpx.Client) -> None:
    """Probes and uptime checkers may send HEAD; it was a 405 before (fixed in api/app.py)."""
    head = http.head("/health")
    assert head.status_code == 200 and head.headers.get("x-request-id")
    assert head.content == b""


@pytest.mark.parametrize(
    "path",
    ["/v1/models", "/v1/models/{model}", "/v1/dllm/info", "/metrics", "/version", "/docs",
     "/redoc", "/openapi.json", "/static/playground.js"],
)  # fmt: skip
def test_head_answers_wherever_get_does(http: httpx.Client, path: str) -> None:
    """RFC 9110: HEAD wherever GET is (found by QA: a 405 on every route but two)."""
    path = path.format(model=http.get("/v1/models").json()["data"][0]["id"])
    get, head = http.get(path), http.head(path)
    assert get.status_code == head.status_code == 200, (head.status_code, head.text)
    assert head.content == b"" and get.content
    assert head.headers["content-type"] == get.headers["content-type"]
    assert head.headers.get("x-request-id")
    if path != "/metrics":  # the other bodies do not change between two calls
        assert head.headers["content-length"] == get.headers["content-length"]


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [("PUT", "/v1/models", "GET, HEAD"), ("GET", CHAT, "POST"), ("HEAD", CHAT, "POST"),
     ("DELETE", "/health", "GET, HEAD")],
)  # fmt: skip
def test_405_names_the_allowed_methods(
    http: httpx.Client, method: str, path: str, allow: str
) -> None:
    """RFC 9110 §15.5.6: a 405 carries Allow (found by QA: the envelope dropped it)."""
    response = http.request(method, path)
    assert response.status_code == 405
    assert response.headers["allow"] == allow
    if method != "HEAD":
        assert_envelope(response)
        assert response.json()["error"]["message"] == f"Method Not Allowed: {method} {path}"


def test_head_on_the_front_page_answers_like_get(http: httpx.Client) -> None:
    get, head = http.get("/"), http.head("/")
    assert get.status_code == head.status_code == 200
    assert head.headers["content-type"] == get.headers["content-type"] == "text/html; charset=utf-8"
    assert head.content == b"" and get.content.startswith(b"<!")
