"""The playground's server side: the page and its assets offline, /docs without a CDN, the
model info, and the trace stream (events consistent with the answer and the usage)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from dllm_serve.api.app import build_app
from dllm_serve.api.playground import DOCS_STATIC, STATIC
from dllm_serve.config import ServerConfig
from dllm_serve.engine.engine import AsyncEngine
from dllm_serve.models.loader import load_model

QUESTION = {"messages": [{"role": "user", "content": "What is 1 + 2?"}], "max_tokens": 16}
URL = re.compile(r"https?://")


def _client(model: str, **config: object) -> TestClient:
    engine = AsyncEngine(load_model(model, device="cpu", dtype="float32"))
    return TestClient(build_app(engine, ServerConfig(**config)))


def _events(text: str) -> list[tuple[str, dict]]:
    out, name = [], None
    for line in text.replace("\r\n", "\n").splitlines():
        if line.startswith("event:"):
            name = line.removeprefix("event:").strip()
        elif line.startswith("data:"):
            out.append((name, json.loads(line.removeprefix("data:"))))
    return out


def test_page_and_docs_load_nothing_from_the_network() -> None:
    with _client("tiny-llada") as client:
        page = client.get("/")
        docs = client.get("/docs")
        redoc = client.get("/redoc")
        assert page.status_code == docs.status_code == redoc.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        for html in (page.text, docs.text, redoc.text):
            refs = re.findall(r'(?:src|href)\s*[=:]\s*["\']([^"\']+)', html)
            assert refs, html
            local = [r for r in refs if r.startswith("/") or r.startswith("#")]
            assert local == refs, refs
            for ref in refs:
                if ref.startswith("/static/"):
                    assert client.get(ref).status_code == 200, ref
        assert '"validatorUrl": null' in docs.text
        assert "fonts.googleapis" not in redoc.text
        # The ReDoc bundle itself draws a logo from its CDN: the page forbids remote images.
        assert redoc.headers["content-security-policy"] == "img-src 'self' data: blob:"
    for name in ("playground.html", "playground.js", "playground.css"):
        assert not URL.search((STATIC / name).read_text()), name


def test_model_info_names_the_decoding_mode() -> None:
    with _client("demo-idlm") as client:
        info = client.get("/v1/dllm/info").json()
    assert info["model"] == "demo-idlm"
    assert info["decoding_mode"] == "self_speculation"
    assert info["default_max_tokens"] == 32
    assert info["default_block_length"] is None  # no block to name without denoising
    with _client("demo-trimode") as client:
        info = client.get("/v1/dllm/info").json()
    # The trained block, the only one a diffusion-mode request may name (was 32, a 400).
    assert info["decoding_mode"] == "tri_mode" and info["default_block_length"] == 16


def test_denoising_trace_commits_every_cell_once_and_matches_the_chat_answer() -> None:
    with _client("tiny-llada") as client:
        events = _events(client.post("/v1/dllm/trace", json=QUESTION).text)
        chat = client.post("/v1/chat/completions", json=QUESTION).json()
    names = [name for name, _ in events]
    assert names[0] == "start" and names[-1] == "done"
    start = events[0][1]
    assert start == {
        "type": "start",
        "mode": "diffusion",
        "canvas": 16,
        "max_tokens": 16,
        "block_length": 16,
        "steps": 16,
        # The prompt's length, as the chat answer's usage counts it.
        "prompt_tokens": chat["usage"]["prompt_tokens"],
    }
    steps = [data for name, data in events if name == "step"]
    assert [s["nfe"] for s in steps] == list(range(1, len(steps) + 1))
    committed = [pos for s in steps for pos, _, _ in s["commits"]]
    assert len(committed) == len(set(committed))  # a committed cell never changes
    assert [s["masked"] for s in steps] == [16 - len(committed[:i]) for i in _cumulative(steps)]
    done = events[-1][1]
    assert done["content"] == chat["choices"][0]["message"]["content"]
    assert done["usage"] == chat["usage"]
    assert "".join(d["content"] for name, d in events if name == "delta") == done["content"]


def _cumulative(steps: list[dict]) -> list[int]:
    total, out = 0, []
    for s in steps:
        total += len(s["commits"])
        out.append(total)
    return out


def test_self_speculation_trace_rounds_add_up_to_the_usage() -> None:
    with _client("demo-idlm") as client:
        events = _events(client.post("/v1/dllm/trace", json=QUESTION).text)
        chat = client.post("/v1/chat/completions", json=QUESTION).json()
    assert events[0][1] == {
        "type": "start",
        "mode": "self_speculation",
        "max_tokens": 16,
        "prompt_tokens": chat["usage"]["prompt_tokens"],
    }
    rounds = [data for name, data in events if name == "round"]
    done = events[-1][1]
    usage = done["usage"]["diffusion"]
    assert len(rounds) == usage["nfe"]
    assert (
        [r["round"] for r in rounds]
        == [r["nfe"] for r in rounds]
        == list(range(1, len(rounds) + 1))
    )
    assert sum(len(r["drafts"]) for r in rounds) == usage["drafted_tokens"]
    assert sum(r["accepted"] for r in rounds) == usage["accepted_drafts"]
    assert all(0 <= r["accepted"] <= len(r["drafts"]) for r in rounds)
    # Every emitted token is the answer's (the stop id is not emitted).
    assert sum(len(r["emitted"]) for r in rounds) == done["usage"]["completion_tokens"]
    assert done["content"] == chat["choices"][0]["message"]["content"]


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"stream": False}, "stream", "The trace endpoint always streams; omit 'stream'."),
        (
            # Found by a code review: accepted with stream: true, and then did nothing.
            {"stream": True, "stream_options": {"include_usage": False}},
            "stream_options",
            "'stream_options' is not supported by the trace endpoint: its done event always "
            "carries the usage.",
        ),
        (
            {"stop": ["x"], "include_stop_str_in_output": True},
            "include_stop_str_in_output",
            "'include_stop_str_in_output' is not supported by the trace endpoint.",
        ),
        (
            {"block_length": 5},
            "block_length",
            "'block_length' (5) must divide the canvas length (16).",
        ),
    ],
)
def test_trace_rejects_what_it_cannot_do(extra: dict, param: str, message: str) -> None:
    with _client("tiny-llada") as client:
        reply = client.post("/v1/dllm/trace", json={**QUESTION, **extra})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == param
    assert reply.json()["error"]["message"] == message


def test_trace_needs_the_api_key_and_the_page_does_not() -> None:
    with _client("tiny-llada", api_key="sekret") as client:
        assert client.get("/").status_code == 200
        assert client.get("/static/playground.js").status_code == 200
        assert client.post("/v1/dllm/trace", json=QUESTION).status_code == 401
        assert client.get("/v1/dllm/info").status_code == 401
        ok = client.post(
            "/v1/dllm/trace", json=QUESTION, headers={"Authorization": "Bearer sekret"}
        )
        assert ok.status_code == 200
        assert _events(ok.text)[-1][0] == "done"


def test_static_dirs_exist() -> None:
    assert (DOCS_STATIC / "swagger-ui-bundle.js").is_file()
    assert (DOCS_STATIC / "redoc.standalone.js").is_file()
    assert Path(STATIC, "playground.html").is_file()


def test_an_editing_trace_shows_what_each_edit_replaced(tmp_path: Path) -> None:
    """LLaDA2.1 token editing: a step may rewrite a written token; its event says what the
    position held (``replaced``), every commit carries the confidence it was made with, and
    replaying the events rebuilds the answer."""
    from dllm_serve_train.tiny_checkpoints import write_tiny_llada2

    model = str(write_tiny_llada2(tmp_path / "llada2", block_size=4, seed=3))
    body = {**QUESTION, "max_tokens": 10, "confidence_threshold": 0.002, "edit_threshold": 0.0}
    with _client(model) as client:
        info = client.get("/v1/dllm/info").json()
        events = _events(client.post("/v1/dllm/trace", json=body).text)
        chat = client.post("/v1/chat/completions", json=body).json()
    assert "joint_threshold" in info["commit_rules"]
    steps = [data for name, data in events if name == "step"]
    canvas: dict[int, str] = {}
    edits = 0
    for step in steps:
        assert len(step["replaced"]) == len(step["commits"]) == len(step["confidences"])
        for (pos, _, text), was, confidence in zip(
            step["commits"], step["replaced"], step["confidences"], strict=True
        ):
            assert was == canvas.get(pos)  # None: the position was masked
            assert isinstance(confidence, float) and 0 < confidence <= 1
            edits += was is not None
            canvas[pos] = text
    assert edits > 0
    done = events[-1][1]
    assert done["content"] == chat["choices"][0]["message"]["content"]
    assert done["usage"]["diffusion"]["nfe"] == len(steps)


def test_a_renoise_trace_shows_each_steps_argmax_canvas(tmp_path: Path) -> None:
    """DiffusionGemma: one event per forward with the canvas's current argmax tokens and which
    changed; a canvas's last argmax is the answer's text for that canvas."""
    from dllm_serve_train.tiny_checkpoints import write_tiny_diffusion_gemma

    model = str(write_tiny_diffusion_gemma(tmp_path / "dg", canvas_length=16, seed=2))
    body = {"messages": QUESTION["messages"], "max_tokens": 24, "seed": 3,
            "num_denoising_steps": 6}  # fmt: skip
    with _client(model) as client:
        events = _events(client.post("/v1/dllm/trace", json=body).text)
        chat = client.post("/v1/chat/completions", json=body).json()
    start = events[0][1]
    assert (start["mode"], start["canvas"], start["steps"]) == ("renoise", 16, 6)
    steps = [data for name, data in events if name == "renoise"]
    denoising = [s for s in steps if s["tokens"]]
    assert denoising and all(len(s["tokens"]) == 16 for s in denoising)
    assert all(set(s["changed"]) <= set(range(16)) for s in denoising)
    assert max(s["step"] for s in steps) <= 6
    assert [s["nfe"] for s in steps] == list(range(1, len(steps) + 1))
    done = events[-1][1]
    assert done["content"] == chat["choices"][0]["message"]["content"]
    assert steps[-1]["answer_tokens"] == done["usage"]["completion_tokens"]
