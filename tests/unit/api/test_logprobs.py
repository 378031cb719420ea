"""``logprobs``: each answer token's log-probability from the forward that committed it.

On tiny LLaDA at T = 0 with one commit per step, a reference loop (full forwards, the mask id
excluded, the committed position's log-softmax) must give the same tokens, logprobs and
alternatives as the server's response; streamed entries join to the non-streamed ones; block
diffusion (editing included) reports one entry per answer token; a model that does not record
them refuses the field.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from dllm_serve.api.app import build_app
from dllm_serve.config import ServerConfig
from dllm_serve.engine.engine import AsyncEngine
from dllm_serve.models.loader import LoadedModel, load_model
from dllm_serve_train.tiny_checkpoints import (
    write_tiny_fastdllm,
    write_tiny_llada2,
)

pytestmark = pytest.mark.usefixtures("one_thread")

MESSAGES = [{"role": "user", "content": "What is 1 + 2?"}]
GEN = 12


def client_for(loaded: LoadedModel) -> TestClient:
    return TestClient(build_app(AsyncEngine(loaded), ServerConfig()))


@torch.no_grad()
def reference(loaded: LoadedModel, prompt: list[int], k: int) -> list[tuple[int, float, list]]:
    """(token, logprob, [(alternative, logprob)] * k) per answer token, cut at a stop id."""
    mask = loaded.mask_id
    x = prompt + [mask] * GEN
    lo, n = len(prompt), len(prompt) + GEN
    every = torch.ones(1, 1, n, n, dtype=torch.bool)
    entries: dict[int, tuple[int, float, list]] = {}
    for _ in range(GEN):
        masked = [p for p in range(lo, n) if x[p] == mask]
        hidden = loaded.model(torch.tensor([x]), torch.arange(n)[None], every)
        z = loaded.model.lm_head(hidden[0, masked]).float()
        z[:, mask] = -float("inf")
        log_probs = torch.log_softmax(z, -1)
        best = int(log_probs.max(-1).values.argmax())  # the most confident, first of equals
        token = int(log_probs[best].argmax())
        top = log_probs[best].topk(k)
        alternatives = list(zip(top.indices.tolist(), top.values.tolist(), strict=True))
        entries[masked[best]] = (token, float(log_probs[best, token]), alternatives)
        x[masked[best]] = token
    out = []
    for p in range(lo, n):
        if x[p] in loaded.stop_ids:
            break
        out.append(entries[p])
    return out


@pytest.fixture(scope="module")
def llada() -> LoadedModel:
    return load_model("tiny-llada", device="cpu", dtype="float32")


def test_chat_logprobs_equal_the_committing_forwards(llada: LoadedModel) -> None:
    body = {"messages": MESSAGES, "max_tokens": GEN, "block_length": GEN,
            "num_denoising_steps": GEN, "logprobs": True, "top_logprobs": 3}  # fmt: skip
    with client_for(llada) as client:
        reply = client.post("/v1/chat/completions", json=body).json()
        stream = client.post("/v1/chat/completions", json={**body, "stream": True}).text
    want = reference(llada, llada.chat_prompt_ids(MESSAGES), 3)
    content = reply["choices"][0]["logprobs"]["content"]
    assert len(content) == reply["usage"]["completion_tokens"] == len(want)
    piece = lambda t: llada.tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
    for got, (token, lp, alternatives) in zip(content, want, strict=True):
        assert got["token"] == piece(token) and got["bytes"] == list(piece(token).encode())
        assert got["logprob"] == pytest.approx(lp, abs=1e-5)
        assert [a["token"] for a in got["top_logprobs"]] == [piece(t) for t, _ in alternatives]
        for a, (_, alt) in zip(got["top_logprobs"], alternatives, strict=True):
            assert a["logprob"] == pytest.approx(alt, abs=1e-5)
            assert got["logprob"] >= a["logprob"] - 1e-6  # greedy: the chosen is the top one
    streamed = []
    for line in stream.splitlines():
        if line.startswith("data:") and line != "data: [DONE]":
            for choice in json.loads(line.removeprefix("data:"))["choices"]:
                streamed += (choice["logprobs"] or {}).get("content", [])
    assert streamed == content


def test_completion_logprobs_in_the_legacy_shape(llada: LoadedModel) -> None:
    body = {"prompt": "1 + 2 =", "max_tokens": 8, "logprobs": 2}
    with client_for(llada) as client:
        reply = client.post("/v1/completions", json=body).json()
    logprobs = reply["choices"][0]["logprobs"]
    n = reply["usage"]["completion_tokens"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == n
    assert all(len(top) <= 2 for top in logprobs["top_logprobs"])
    assert "".join(logprobs["tokens"]).startswith(reply["choices"][0]["text"][:1])
    offsets = [0]
    for token in logprobs["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs["text_offset"] == offsets[:n]


def test_block_diffusion_and_editing_report_one_entry_per_token(tmp_path: Path) -> None:
    loaded = load_model(str(write_tiny_llada2(tmp_path / "m", block_size=4, seed=3)),
                        device="cpu", dtype="float32")  # fmt: skip
    with client_for(loaded) as client:
        for extra in ({}, {"edit_threshold": 0.0, "confidence_threshold": 0.002}):
            body = {"messages": MESSAGES, "max_tokens": 10, "logprobs": True, **extra}
            reply = client.post("/v1/chat/completions", json=body).json()
            content = reply["choices"][0]["logprobs"]["content"]
            assert len(content) == reply["usage"]["completion_tokens"] > 0
            assert all(e["logprob"] <= 0 and e["top_logprobs"] == [] for e in content)


def test_models_that_do_not_record_logprobs_refuse_them(tmp_path: Path) -> None:
    fast = load_model(str(write_tiny_fastdllm(tmp_path / "f")), device="cpu", dtype="float32")
    trimode = load_model("demo-trimode", device="cpu", dtype="float32")
    for loaded, extra in ((fast, {}), (trimode, {"decoding_mode": "diffusion"})):
        with client_for(loaded) as client:
            body = {"messages": MESSAGES, "logprobs": True, **extra}
            reply = client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 400
        error = reply.json()["error"]
        assert (error["param"], error["code"]) == ("logprobs", "not_applicable")


@torch.no_grad()
def causal_reference(loaded: LoadedModel, prompt: list[int], n: int, k: int) -> list[tuple]:
    """Greedy AR with full causal forwards: (token, logprob, top-k) per answer token."""
    ids, out = list(prompt), []
    for _ in range(n):
        size = len(ids)
        causal = torch.tril(torch.ones(size, size, dtype=torch.bool))[None, None]
        hidden = loaded.model(torch.tensor([ids]), torch.arange(size)[None], causal)
        z = loaded.model.lm_head(hidden[0, -1]).float()
        z[loaded.mask_id] = -float("inf")
        log_probs = torch.log_softmax(z, -1)
        token = int(log_probs.argmax())
        if token in loaded.stop_ids:
            break
        top = log_probs.topk(k)
        out.append((token, float(log_probs[token]), top.indices.tolist(), top.values.tolist()))
        ids.append(token)
    return out


def test_self_speculation_logprobs_equal_the_causal_forwards() -> None:
    """I-DLM's ISD (greedy == AR): each emitted token's entry is the causal distribution at
    its position, whether it was an accepted draft or the verifier's own token."""
    loaded = load_model("demo-idlm", device="cpu", dtype="float32")  # trained: drafts accepted
    prompt = loaded.chat_prompt_ids([{"role": "user", "content": "What is 123 + 456?"}])
    body = {"prompt": prompt, "max_tokens": 12, "logprobs": 2}
    with client_for(loaded) as client:
        reply = client.post("/v1/completions", json=body).json()
    logprobs = reply["choices"][0]["logprobs"]
    want = causal_reference(loaded, body["prompt"], 12, 2)
    piece = lambda t: loaded.tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
    assert logprobs["tokens"] == [piece(t) for t, _, _, _ in want]
    for got, top, (_, lp, ids, values) in zip(
        logprobs["token_logprobs"], logprobs["top_logprobs"], want, strict=True
    ):
        assert got == pytest.approx(lp, abs=1e-4)
        assert list(top) == [piece(t) for t in ids]
        assert list(top.values()) == pytest.approx(values, abs=1e-4)
    assert reply["usage"]["diffusion"]["accepted_drafts"] > 0  # drafts were accepted too


def test_linear_spec_logprobs_equal_ar_ones() -> None:
    """A tri-mode model's linear_spec emits exactly ar's tokens, from the same causal view:
    the same entries, whether a token was a matched draft or a bonus."""
    trimode = load_model("demo-trimode", device="cpu", dtype="float32")
    entries = {}
    with client_for(trimode) as client:
        for mode in ("ar", "linear_spec"):
            body = {"messages": MESSAGES, "logprobs": True, "top_logprobs": 2,
                    "decoding_mode": mode}  # fmt: skip
            reply = client.post("/v1/chat/completions", json=body).json()
            entries[mode] = reply["choices"][0]["logprobs"]["content"]
            assert len(entries[mode]) == reply["usage"]["completion_tokens"] > 0
    assert [e["token"] for e in entries["ar"]] == [e["token"] for e in entries["linear_spec"]]
    for a, b in zip(entries["ar"], entries["linear_spec"], strict=True):
        assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)
        assert [t["token"] for t in a["top_logprobs"]] == [t["token"] for t in b["top_logprobs"]]


def test_top_logprobs_needs_logprobs(llada: LoadedModel) -> None:
    with client_for(llada) as client:
        reply = client.post("/v1/chat/completions", json={"messages": MESSAGES, "top_logprobs": 2})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "top_logprobs"
