"""Issue 15 in process (httpx over ASGI, the real engine on demo-llada): /v1/completions,
/v1/models/{id}, continuous usage, ignore_eos, stop_token_ids, include_stop_str_in_output,
and every 400 counted in dllm:requests_rejected_total and logged with its param and code."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from dllm_serve.api.app import build_app
from dllm_serve.config import ServerConfig
from dllm_serve.engine.engine import AsyncEngine
from dllm_serve.models.loader import LoadedModel, load_model

QUESTION = [{"role": "user", "content": "What is 123 + 456?"}]
ANSWER = "123 + 456 = 579"  # demo-llada's greedy answer at its default canvas (32)
# The same question as a raw prompt: the demo's chat template, written out.
RAW_PROMPT = (
    "<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nWhat is 123 + 456?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
)


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model("demo-llada", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def app(loaded: LoadedModel) -> Iterator[FastAPI]:
    engine = AsyncEngine(loaded)
    engine.start()
    yield build_app(engine, ServerConfig())
    engine.shutdown()


def call(app: FastAPI, method: str, path: str, **kwargs: Any) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://test", timeout=120
        ) as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(go())


def events(response: httpx.Response) -> list[Any]:
    """The SSE ``data:`` payloads, JSON-decoded ([DONE] kept as the string)."""
    out = []
    for line in response.text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def chat(app: FastAPI, **fields: Any) -> httpx.Response:
    return call(app, "POST", "/v1/chat/completions", json={"messages": QUESTION, **fields})


def test_demo_answer_at_defaults(app: FastAPI) -> None:
    body = chat(app).json()
    assert body["choices"][0]["message"]["content"] == ANSWER
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 14


# ---- /v1/completions -------------------------------------------------------------------------
def test_completion_raw_prompt(app: FastAPI, loaded: LoadedModel) -> None:
    response = call(
        app,
        "POST",
        "/v1/completions",
        json={"model": "x", "prompt": RAW_PROMPT},
        headers={"X-Request-ID": "cmp-1"},
    )
    assert response.status_code == 200
    body = response.json()
    assert body["id"] == "cmpl-cmp-1"
    assert body["object"] == "text_completion"
    assert body["model"] == "demo-llada"
    assert body["choices"] == [
        {"index": 0, "text": ANSWER, "logprobs": None, "finish_reason": "stop"}
    ]
    # The raw prompt is the chat template written out: no template added around it.
    assert body["usage"]["prompt_tokens"] == len(loaded.chat_prompt_ids(QUESTION))
    assert body["usage"]["completion_tokens"] == 14
    assert body["usage"]["diffusion"]["canvas_length"] == 32


def test_completion_token_ids_and_list_prompt(app: FastAPI, loaded: LoadedModel) -> None:
    ids = loaded.chat_prompt_ids(QUESTION)
    for prompt in (ids, [ids], [RAW_PROMPT]):
        body = call(app, "POST", "/v1/completions", json={"prompt": prompt}).json()
        assert body["choices"][0]["text"] == ANSWER, prompt


def test_completion_stream(app: FastAPI) -> None:
    response = call(
        app,
        "POST",
        "/v1/completions",
        json={"prompt": RAW_PROMPT, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert response.status_code == 200
    chunks = events(response)
    assert chunks[-1] == "[DONE]"
    body = chunks[:-1]
    assert {c["object"] for c in body} == {"text_completion"}
    assert len({c["id"] for c in body}) == 1 and body[0]["id"].startswith("cmpl-")
    text = "".join(c["choices"][0]["text"] for c in body if c["choices"])
    assert text == ANSWER
    finishes = [c["choices"][0]["finish_reason"] for c in body if c["choices"]]
    assert finishes[-1] == "stop" and finishes.count("stop") == 1
    assert all(c["usage"] is None for c in body[:-1])
    assert body[-1]["choices"] == []
    assert body[-1]["usage"]["completion_tokens"] == 14


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"prompt": RAW_PROMPT, "suffix": 5}, "suffix", None),  # text only (infilling)
        ({"prompt": RAW_PROMPT, "logprobs": 6}, "logprobs", None),  # OpenAI's bound: 5
        ({"prompt": RAW_PROMPT, "logprobs": -1}, "logprobs", None),
        ({"prompt": RAW_PROMPT, "echo": True}, "echo", "unsupported_parameter"),
        ({"prompt": RAW_PROMPT, "best_of": 2}, "best_of", "unsupported_parameter"),
        ({"prompt": ["a", "b"]}, "prompt", "unsupported_parameter"),
        ({"prompt": []}, "prompt", None),
        ({"prompt": [["a"]]}, "prompt", None),  # one malformed prompt, not a batch
        ({"prompt": [[5, "a"]]}, "prompt", None),
        ({"prompt": [5, 99999]}, "prompt[1]", None),
        ({"prompt": [5, 1011]}, "prompt[1]", None),  # the mask token
        # One prompt wrapped in a list: the path into the body (found by QA: prompt[1], which
        # the body does not have, and prompt[0], the inner list, not the token).
        ({"prompt": [[5, -3]]}, "prompt[0][1]", None),
        ({"prompt": [[1011]]}, "prompt[0][0]", None),
        ({"prompt": [""]}, "prompt[0]", None),
        ({"prompt": ""}, "prompt", None),
        ({}, "prompt", None),
        ({"prompt": "x", "messages": QUESTION}, "messages", None),
        ({"prompt": "x", "top_p": 0.5}, "top_p", "unsupported_parameter"),
    ],
)
def test_completion_rejections(
    app: FastAPI, fields: dict[str, Any], param: str, code: str | None
) -> None:
    response = call(app, "POST", "/v1/completions", json=fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (
        param,
        code,
        "invalid_request_error",
    )


def test_the_mask_token_as_text_is_refused_like_its_id(app: FastAPI, loaded: LoadedModel) -> None:
    mask = loaded.tokenizer.convert_ids_to_tokens(loaded.mask_id)
    assert loaded.prompt_ids(f"2 + 2 = {mask}").count(loaded.mask_id) == 1  # one token as text
    message = [{"role": "user", "content": f"What is 2 + 2? {mask}{mask}"}]
    for path, body, param in (
        ("/v1/completions", {"prompt": f"What is 2 + 2? {mask}"}, "prompt"),
        ("/v1/chat/completions", {"messages": message}, "messages"),
        ("/v1/chat/completions", {"messages": message, "stream": True}, "messages"),
    ):
        response = call(app, "POST", path, json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["code"], error["type"]) == (
            param, None, "invalid_request_error",
        )  # fmt: skip
        assert f"contains the model's mask token (id {loaded.mask_id})" in error["message"]
    # The same words without the token are fine.
    assert chat(app, messages=[{"role": "user", "content": "What is 2 + 2?"}]).status_code == 200


def test_completion_accepts_noops(app: FastAPI) -> None:
    fields = {"suffix": "", "echo": False, "best_of": 1, "logprobs": None, "n": 1, "user": "u"}
    body = call(app, "POST", "/v1/completions", json={"prompt": RAW_PROMPT, **fields}).json()
    assert body["choices"][0]["text"] == ANSWER


# ---- /v1/models/{id} -------------------------------------------------------------------------
def test_retrieve_model(app: FastAPI) -> None:
    response = call(app, "GET", "/v1/models/demo-llada")
    assert response.status_code == 200
    card = response.json()
    assert (card["id"], card["object"], card["owned_by"]) == ("demo-llada", "model", "dllm-serve")
    assert card == call(app, "GET", "/v1/models").json()["data"][0]


def test_retrieve_unknown_model_is_404(app: FastAPI) -> None:
    response = call(app, "GET", "/v1/models/org/other-model")
    assert response.status_code == 404
    assert response.json() == {
        "error": {
            "message": "The model 'org/other-model' does not exist. This server serves "
            "'demo-llada'.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }


# ---- honoured vLLM extensions -----------------------------------------------------------------
def test_continuous_usage_stats(app: FastAPI, loaded: LoadedModel) -> None:
    prompt = len(loaded.chat_prompt_ids(QUESTION))
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = events(chat(app, stream=True, stream_options=options))[:-1]
    assert all(c["usage"] is not None for c in chunks)
    # The role chunk comes before any step: zero counts, but the same shape as the others.
    assert chunks[0]["usage"] == {
        "prompt_tokens": prompt,
        "completion_tokens": 0,
        "total_tokens": prompt,
        "prompt_tokens_details": {"cached_tokens": 0},
        "diffusion": {
            "nfe": 0, "canvas_length": 32, "committed_tokens": 0, "tokens_per_forward": 0.0,
        },
    }  # fmt: skip
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 14
    nfes = [c["usage"]["diffusion"]["nfe"] for c in chunks]
    assert nfes == sorted(nfes) and nfes[0] == 0 and nfes[-1] == 32
    assert all(c["usage"]["diffusion"]["canvas_length"] == 32 for c in chunks)
    for c in chunks:
        assert c["usage"]["total_tokens"] == prompt + c["usage"]["completion_tokens"]
    assert chunks[-1]["choices"] == []  # include_usage: the final usage-only chunk
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == ANSWER


def test_ignore_eos_decodes_the_whole_canvas(app: FastAPI) -> None:
    body = chat(app, ignore_eos=True).json()
    assert body["usage"]["completion_tokens"] == 32  # the whole canvas, EOS padding included
    assert body["usage"]["diffusion"]["canvas_length"] == 32
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["message"]["content"].startswith(ANSWER)
    body = chat(app, ignore_eos=True, max_tokens=48).json()
    assert body["usage"]["completion_tokens"] == 48
    assert chat(app, ignore_eos=False).json()["usage"]["completion_tokens"] == 14


def test_stop_token_ids(app: FastAPI, loaded: LoadedModel) -> None:
    equals = loaded.tokenizer.convert_tokens_to_ids("=")
    body = chat(app, stop_token_ids=[equals]).json()
    assert body["choices"][0]["message"]["content"] == "123 + 456 "
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 9


def test_stop_token_ids_end_the_answer_with_ignore_eos(app: FastAPI, loaded: LoadedModel) -> None:
    # ignore_eos ignores the model's EOS/EOT only (vLLM): the client's own stop ids still end
    # the answer, exactly where they do without it.
    equals = loaded.tokenizer.convert_tokens_to_ids("=")
    body = chat(app, stop_token_ids=[equals], ignore_eos=True).json()
    assert body["choices"][0]["message"]["content"] == "123 + 456 "
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 9


@pytest.mark.parametrize(
    ("ids", "param", "message"),
    [
        ([1024], "stop_token_ids[0]", "outside the model's vocabulary (0 to 1023)"),
        ([5, -1], "stop_token_ids[1]", "outside the model's vocabulary"),
        ([1011], "stop_token_ids[0]", "is the model's mask token"),
    ],
)
def test_stop_token_ids_are_checked(app: FastAPI, ids: list[int], param: str, message: str) -> None:
    response = chat(app, stop_token_ids=ids)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param
    assert message in response.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output(app: FastAPI, stream: bool) -> None:
    def answer(**fields: Any) -> tuple[str, str]:
        response = chat(app, stop=["= ", "#"], stream=stream, **fields)
        if not stream:
            choice = response.json()["choices"][0]
            return choice["message"]["content"], choice["finish_reason"]
        chunks = [c for c in events(response)[:-1] if c["choices"]]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        return text, chunks[-1]["choices"][0]["finish_reason"]

    assert answer() == ("123 + 456 ", "stop")
    assert answer(include_stop_str_in_output=True) == ("123 + 456 = ", "stop")
    assert answer(include_stop_str_in_output=False) == ("123 + 456 ", "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_counts_the_tokens_through_it_kept_or_not(
    app: FastAPI, loaded: LoadedModel, stream: bool
) -> None:
    """``completion_tokens`` is the answer tokens that produced the text through the stop
    string (vLLM's count), whether or not the string is kept, and never the tokens committed
    after it (which depend on when the stop was seen)."""

    def usage(**fields: Any) -> int:
        options = {"stream_options": {"include_usage": True}} if stream else {}
        response = chat(app, stop=["= "], stream=stream, **options, **fields)
        body = events(response)[-2] if stream else response.json()
        return body["usage"]["completion_tokens"]

    through = len(loaded.tokenizer.encode("123 + 456 = ", add_special_tokens=False))
    answer = len(loaded.tokenizer.encode(ANSWER, add_special_tokens=False))
    assert through < answer  # the stop ends the answer early
    assert usage() == usage(include_stop_str_in_output=True) == through


@pytest.mark.parametrize("stream", [False, True])
def test_a_canvas_the_block_does_not_divide_gives_the_same_answer(
    app: FastAPI, stream: bool
) -> None:
    """max_tokens 1001 (7 x 11 x 13: no block of 16-32 divides it) is decoded as a 1024 canvas
    in the model's blocks of 32 and cut at 1001, so it answers as 1024 does (it used to be one
    1001-token block, which the demo answers with noise)."""
    options = {"stream_options": {"include_usage": True}} if stream else {}
    response = chat(app, max_tokens=1001, stream=stream, **options)
    if stream:
        chunks = events(response)[:-1]
        text = "".join(
            c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
        )
        usage = chunks[-1]["usage"]
    else:
        text, usage = response.json()["choices"][0]["message"]["content"], response.json()["usage"]
    assert text == ANSWER
    assert usage["diffusion"]["canvas_length"] == 1024 and usage["diffusion"]["nfe"] == 32
    assert usage["completion_tokens"] == 14


def test_a_rounded_canvas_returns_at_most_max_tokens(app: FastAPI) -> None:
    body = chat(app, max_tokens=41, ignore_eos=True).json()
    assert body["usage"]["completion_tokens"] == 41  # not the 64 of the rounded canvas
    assert body["usage"]["diffusion"]["canvas_length"] == 64
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["message"]["content"].startswith(ANSWER)


@pytest.mark.parametrize(
    "fields",
    [
        {"max_tokens": 3001},
        {"max_completion_tokens": 2049},
        {"max_tokens": 16385},
        {"target_length": 3000},
    ],
)
def test_max_tokens_past_the_context_is_refused(app: FastAPI, fields: dict[str, int]) -> None:
    # No block divides these: they used to be shrunk to a 1,984-token canvas (200) or refused
    # on a block_length the client never sent.
    response = chat(app, **fields)
    assert response.status_code == 400
    error = response.json()["error"]
    ((field, value),) = fields.items()
    # The param is the field the client sent (found by QA: max_completion_tokens was named
    # max_tokens).
    assert (error["param"], error["code"]) == (field, "context_length_exceeded")
    assert f"{value} in the completion canvas" in error["message"]


def test_long_canvas_is_decoded_in_the_model_block(app: FastAPI) -> None:
    body = chat(app, max_tokens=256).json()
    diffusion = body["usage"]["diffusion"]
    assert diffusion["canvas_length"] == 256
    # Blocks of 32 (generation_config.json), 32 steps each: EOS in the first block ends it.
    assert diffusion["nfe"] == 32
    assert body["choices"][0]["finish_reason"] == "stop"


# ---- rejections are counted and logged --------------------------------------------------------
def rejected(app: FastAPI) -> dict[str, float]:
    text = call(app, "GET", "/metrics").text
    out = {}
    for line in text.splitlines():
        if line.startswith("dllm:requests_rejected_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('reason="', 1)[1].split('"', 1)[0]] = float(value)
    return out


def test_every_400_is_counted_and_logged_without_the_prompt(
    loaded: LoadedModel, caplog: pytest.LogCaptureFixture
) -> None:
    engine = AsyncEngine(loaded)
    engine.start()
    try:
        app = build_app(engine, ServerConfig())
        assert rejected(app) == {}
        secret = [{"role": "user", "content": "secret-prompt-77"}]
        with caplog.at_level(logging.INFO, logger="dllm_serve"):
            for _ in range(2):
                r = call(
                    app, "POST", "/v1/chat/completions", json={"messages": secret, "top_p": 0.5}
                )
                assert r.status_code == 400
            r = call(app, "POST", "/v1/chat/completions", json={"messages": secret, "foo": 1})
            assert r.status_code == 400
            r = call(
                app,
                "POST",
                "/v1/completions",
                content=b"{",
                headers={"content-type": "application/json"},
            )
            assert r.status_code == 400
            r = call(app, "GET", "/v1/models", headers={"X-Request-ID": "bad id"})
            assert r.status_code == 400
            r = call(
                app, "POST", "/v1/chat/completions", json={"messages": secret, "max_tokens": 4096}
            )
            assert r.status_code == 400
        assert rejected(app) == {
            "unsupported_parameter": 2.0,
            "invalid_request": 2.0,
            "invalid_request_id": 1.0,
            "context_length_exceeded": 1.0,
        }
        logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rejected")]
        assert logged[0] == (
            "rejected /v1/chat/completions: status=400 param=top_p code=unsupported_parameter"
        )
        assert "param=foo code=invalid_request" in logged[2]
        assert "param=None code=invalid_request_id" in logged[4]
        assert "param=max_tokens code=context_length_exceeded" in logged[5]
        assert len(logged) == 6
        assert not any("secret-prompt-77" in r.getMessage() for r in caplog.records)
    finally:
        engine.shutdown()


def test_log_requests_logs_informational_fields(
    loaded: LoadedModel, caplog: pytest.LogCaptureFixture
) -> None:
    fields = {
        "metadata": {"team": "eval"},
        "prompt_cache_key": "pck-1",
        "safety_identifier": "sid-1",
        "user": "u-1",
        "max_tokens": 8,
    }
    for enabled in (False, True):
        engine = AsyncEngine(loaded)
        engine.start()
        try:
            app = build_app(engine, ServerConfig(log_requests=enabled))
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="dllm_serve"):
                assert chat(app, **fields).status_code == 200
                assert chat(app, top_k=5).status_code == 400
        finally:
            engine.shutdown()
        logged = "\n".join(r.getMessage() for r in caplog.records)
        for value in ("pck-1", "sid-1", "u-1", "'team': 'eval'", "top-k sampling"):
            assert (value in logged) is enabled, value


def test_ignore_eos_and_stop_token_ids_on_a_self_speculative_model() -> None:
    """The same per-request stop set on I-DLM (demo-idlm, exact self-speculation)."""
    idlm = load_model("demo-idlm", device="cpu", dtype="float32")
    engine = AsyncEngine(idlm)
    engine.start()
    try:
        app = build_app(engine, ServerConfig())
        plain = chat(app).json()
        assert plain["choices"][0]["message"]["content"] == ANSWER
        full = chat(app, ignore_eos=True).json()
        assert full["usage"]["completion_tokens"] == 32
        assert full["choices"][0]["finish_reason"] == "length"
        assert full["choices"][0]["message"]["content"].startswith(ANSWER)
        equals = idlm.tokenizer.convert_tokens_to_ids("=")
        cut = chat(app, stop_token_ids=[equals]).json()
        assert cut["choices"][0]["message"]["content"] == "123 + 456 "
        assert cut["choices"][0]["finish_reason"] == "stop"
        # The canvas-only fields are still refused for this model; ignore_eos is not one.
        response = chat(app, ignore_eos=True, block_length=8, max_tokens=32)
        assert response.json()["error"]["param"] == "block_length"
    finally:
        engine.shutdown()
