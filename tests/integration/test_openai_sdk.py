"""End to end: a real uvicorn on 127.0.0.1, talked to with the official openai SDK."""

from __future__ import annotations

import json

import openai
import pytest
from remote_server import RemoteServer

MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]
SMALL = {"max_tokens": 32, "block_length": 8, "num_denoising_steps": 16}


def stream_text(client: openai.OpenAI, **kwargs: object) -> tuple[str, list]:
    chunks = list(
        client.chat.completions.create(model="x", messages=MESSAGES, stream=True, **kwargs)
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def test_plain_completion(server: RemoteServer) -> None:
    client = server.client()
    raw = client.chat.completions.with_raw_response.create(
        model="anything",
        messages=MESSAGES,
        extra_body=SMALL,
        extra_headers={"X-Request-ID": "test-plain-1"},
    )
    assert raw.headers["x-request-id"] == "test-plain-1"
    completion = raw.parse()
    assert completion.id == "chatcmpl-test-plain-1"
    assert completion.object == "chat.completion"
    assert completion.model == "tiny-llada"
    choice = completion.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    usage = completion.usage
    assert usage is not None
    assert 0 <= usage.completion_tokens <= 32
    assert usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # 16 steps over 4 blocks: NFE is at most the step count (fewer only after an early stop).
    diffusion = usage.model_extra["diffusion"]
    assert 1 <= diffusion["nfe"] <= 16
    assert diffusion["canvas_length"] == 32
    # Top-k decoding commits the whole 32-position canvas over its forwards, unless it stopped
    # early at EOS; tokens_per_forward is that ratio.
    assert usage.completion_tokens <= diffusion["committed_tokens"] <= 32
    assert diffusion["tokens_per_forward"] == round(
        diffusion["committed_tokens"] / diffusion["nfe"], 4
    )


def test_generated_request_id_is_uuid7(server: RemoteServer) -> None:
    raw = server.client().chat.completions.with_raw_response.create(
        model="x", messages=MESSAGES, max_tokens=8
    )
    rid = raw.headers["x-request-id"]
    assert rid[14] == "7" and len(rid) == 36  # UUID version nibble
    assert raw.parse().id == f"chatcmpl-{rid}"


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 1234}])
def test_stream_joins_to_plain_answer(server: RemoteServer, sampling: dict) -> None:
    client = server.client()
    plain = client.chat.completions.create(
        model="x", messages=MESSAGES, extra_body=SMALL, **sampling
    )
    text, chunks = stream_text(
        client, extra_body=SMALL, stream_options={"include_usage": True}, **sampling
    )
    assert text == plain.choices[0].message.content
    assert len(text) > 0  # the random tiny model does not answer with EOS straight away
    # OpenAI order: role chunk, content chunks, one finish chunk, usage chunk.
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    finishes = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1
    assert finishes[0].choices[0].finish_reason == plain.choices[0].finish_reason
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1


def test_stream_has_several_content_events(server: RemoteServer) -> None:
    # Four blocks: text becomes final block after block, so it cannot arrive in one piece.
    _, chunks = stream_text(server.client(), extra_body=SMALL)
    contents = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(contents) >= 2


def test_same_seed_same_answer_and_greedy_ignores_seed(server: RemoteServer) -> None:
    client = server.client()

    def answer(**kw: object) -> str:
        out = client.chat.completions.create(model="x", messages=MESSAGES, max_tokens=16, **kw)
        return out.choices[0].message.content

    assert answer(temperature=1.0, seed=7) == answer(temperature=1.0, seed=7)
    assert answer(temperature=0, seed=1) == answer(temperature=0, seed=2) == answer()


def test_n_choices_are_the_seeded_answers_streamed_or_not(server: RemoteServer) -> None:
    """n = 3 at T > 0: choice i is the answer of seed + i, alone; stream == non-stream; the
    usage counts the prompt once and the answers' tokens summed."""
    client = server.client()
    kw = {"max_tokens": 16, "temperature": 1.0}
    alone = [
        client.chat.completions.create(model="x", messages=MESSAGES, seed=7 + i, **kw)
        for i in range(3)
    ]
    together = client.chat.completions.create(model="x", messages=MESSAGES, seed=7, n=3, **kw)
    assert [c.index for c in together.choices] == [0, 1, 2]
    texts = [c.choices[0].message.content for c in alone]
    assert [c.message.content for c in together.choices] == texts
    assert len(set(texts)) > 1  # sampled: the choices differ
    usage = together.usage
    assert usage is not None and usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert usage.completion_tokens == sum(c.usage.completion_tokens for c in alone)
    nfe = sum(c.usage.model_extra["diffusion"]["nfe"] for c in alone)
    assert usage.model_extra["diffusion"]["nfe"] == nfe
    chunks = list(
        client.chat.completions.create(
            model="x", messages=MESSAGES, seed=7, n=3, stream=True,
            stream_options={"include_usage": True}, **kw,
        )
    )  # fmt: skip
    streamed = ["", "", ""]
    finished = []
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.append(choice.index)
    assert streamed == texts and sorted(finished) == [0, 1, 2]
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == usage.completion_tokens
    text = client.completions.create(model="x", prompt="2 + 3 =", n=2, max_tokens=8, seed=1)
    assert [c.index for c in text.choices] == [0, 1]


def test_suffix_infills_between_prompt_and_suffix(server: RemoteServer) -> None:
    from dllm_serve.llm import LLM

    fields = {"max_tokens": 8, "num_denoising_steps": 8}
    reply = server.client().completions.create(
        model="x", prompt="The answer", suffix=" is final.", max_tokens=8,
        extra_body={"num_denoising_steps": 8},
    )  # fmt: skip
    with LLM("tiny-llada", device="cpu", dtype="float32") as llm:
        (want,) = llm.complete(["The answer"], suffix=" is final.", **fields)
        (plain,) = llm.complete(["The answer"], **fields)
    assert reply.choices[0].text == want.text != plain.text
    assert reply.usage is not None and reply.usage.completion_tokens == want.completion_tokens


def test_logprobs_parse_in_the_sdk(server: RemoteServer) -> None:
    client = server.client()
    reply = client.chat.completions.create(
        model="x", messages=MESSAGES, max_tokens=8, logprobs=True, top_logprobs=2
    )
    content = reply.choices[0].logprobs.content
    assert reply.usage is not None and len(content) == reply.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.logprob >= max(a.logprob for a in entry.top_logprobs) - 1e-6  # greedy
    text = client.completions.create(model="x", prompt="1 + 1 =", max_tokens=8, logprobs=1)
    assert len(text.choices[0].logprobs.tokens) == text.usage.completion_tokens


def test_rejected_field_is_400_via_sdk(server: RemoteServer) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(model="x", messages=MESSAGES, top_p=0.5)
    err = info.value
    assert err.status_code == 400
    assert err.body["param"] == "top_p"
    assert err.body["type"] == "invalid_request_error"
    assert "see docs/api-contract.md" in err.body["message"]
    assert err.response.headers["x-request-id"]


def test_unknown_extension_field_is_400(server: RemoteServer) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(
            model="x", messages=MESSAGES, extra_body={"remasking": "random"}
        )
    assert info.value.body["param"] == "remasking"


def test_curl_style_errors_have_envelope_and_request_id(server: RemoteServer) -> None:
    with server.http() as http:
        bad_json = http.post(
            "/v1/chat/completions",
            content=b"{not json",
            headers={"Content-Type": "application/json", "X-Request-ID": "bad-json-1"},
        )
        assert bad_json.status_code == 400
        assert bad_json.headers["x-request-id"] == "bad-json-1"
        assert bad_json.json()["error"]["type"] == "invalid_request_error"

        form = http.post(
            "/v1/chat/completions",
            content=json.dumps({"messages": MESSAGES}),
            headers={"Content-Type": "application/x-www-form-urlencoded"},
        )
        assert form.status_code == 400
        assert "Content-Type" in form.json()["error"]["message"]

        missing = http.get("/v1/nothing-here")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "not_found"
        assert missing.headers["x-request-id"]

        wrong_method = http.get("/v1/chat/completions")
        assert wrong_method.status_code == 405
        assert set(wrong_method.json()["error"]) == {"message", "type", "param", "code"}

        bad_id = http.get("/health", headers={"X-Request-ID": "x" * 300})
        assert bad_id.status_code == 400
        assert bad_id.json()["error"]["code"] == "invalid_request_id"

        too_long = http.post(
            "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 100_000}
        )
        assert too_long.status_code == 400
        assert too_long.json()["error"]["code"] == "context_length_exceeded"


def test_models_health_docs(server: RemoteServer) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny-llada"]
    assert models.data[0].object == "model"
    with server.http() as http:
        assert http.get("/health").status_code == 200
        assert http.get("/version").json()["version"]
        assert http.get("/docs").status_code == 200
        spec = http.get("/openapi.json").json()
        assert "Diffusion vs OpenAI semantics" in spec["info"]["description"]
        assert "docs/api-contract.md" in spec["info"]["description"]
        assert "ADR" not in spec["info"]["description"]
        request_schema = spec["components"]["schemas"]["ChatCompletionRequest"]
        assert "num_denoising_steps" in request_schema["properties"]
