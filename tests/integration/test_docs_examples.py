"""Every request example /openapi.json gives (what /docs' "Try it out" starts from) succeeds
on the default demo model, and answers the question it asks."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from remote_server import RemoteServer


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    log = tmp_path_factory.mktemp("docs-examples") / "server.log"
    server = RemoteServer.start(["--model", "demo-llada", "--log-level", "warning"], log)
    yield server
    server.stop()


def _examples(schema: dict[str, Any]) -> list[tuple[str, str, str, Any]]:
    """(path, method, example name, body) of every request-body example."""
    found = []
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            if "requestBody" not in operation:
                continue
            media = operation["requestBody"]["content"]["application/json"]
            assert media.get("examples"), f"{method} {path} has a request body but no example"
            found += [(path, method, name, ex["value"]) for name, ex in media["examples"].items()]
    return found


def _events(text: str) -> list[tuple[str, str]]:
    """(event name, data) of a server-sent event stream."""
    events = []
    for record in text.replace("\r\n", "\n").split("\n\n"):
        name, data = "message", ""
        for line in record.splitlines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data += line[5:].strip()
        if data:
            events.append((name, data))
    return events


def _answer(path: str, response: httpx.Response) -> str:
    """The answer text, whichever shape the route answers in."""
    if response.headers["content-type"].startswith("application/json"):
        choice = response.json()["choices"][0]
        return choice["message"]["content"] if "message" in choice else choice["text"]
    events = _events(response.text)
    if path == "/v1/dllm/trace":
        [done] = [json.loads(data) for name, data in events if name == "done"]
        return done["content"]
    assert events[-1][1] == "[DONE]"
    chunks = [json.loads(data) for _, data in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] > 0  # the example asks for the usage
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def test_every_request_example_succeeds_and_answers(demo_server: RemoteServer) -> None:
    with httpx.Client(base_url=demo_server.url, timeout=60) as http:
        examples = _examples(http.get("/openapi.json").json())
        assert {(path, name) for path, _, name, _ in examples} == {
            ("/v1/chat/completions", "what_is_2_plus_2"),
            ("/v1/chat/completions", "streamed"),
            ("/v1/completions", "what_is_2_plus_2"),
            ("/v1/dllm/trace", "what_is_2_plus_2"),
        }
        answers = {}
        for path, method, name, body in examples:
            assert body["model"] == "demo-llada"
            response = http.request(method.upper(), path, json=body)
            assert response.status_code == 200, (path, name, response.text)
            answers[path, name] = _answer(path, response)
    # The raw completions prompt is the chat template written out: the same answer.
    assert set(answers.values()) == {"2 + 2 = 4"}, answers


def test_the_examples_name_the_served_model(server: RemoteServer) -> None:
    """On any model (here the suite's random-weight tiny-llada) the examples are accepted."""
    with httpx.Client(base_url=server.url, timeout=60) as http:
        examples = _examples(http.get("/openapi.json").json())
        assert {body["model"] for *_, body in examples} == {"tiny-llada"}
        for path, method, name, body in examples:
            response = http.request(method.upper(), path, json=body)
            assert response.status_code == 200, (path, name, response.text)
