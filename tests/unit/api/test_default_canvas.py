"""A request without max_tokens gets the model's canvas (generation_config.json's
max_new_tokens) when the checkpoint sets one, else 128; steps and block follow
docs/api-contract.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dllm_serve.api.pipeline import parse_chat_request
from dllm_serve.engine.engine import AsyncEngine
from dllm_serve.models.errors import ModelLoadError
from dllm_serve.models.loader import load_model
from dllm_serve_train.tiny_checkpoints import write_tiny

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def parse(body: dict, default: int | None = None):
    raw = json.dumps(body).encode()
    if default is None:
        return parse_chat_request(raw, "application/json").params
    return parse_chat_request(raw, "application/json", default).params


def test_without_max_tokens_the_model_canvas_is_used() -> None:
    params = parse(BODY, 32)
    assert (params.gen_length, params.steps, params.block_length) == (32, 32, 32)


def test_without_a_model_canvas_the_default_is_128() -> None:
    params = parse(BODY)
    assert (params.gen_length, params.steps, params.block_length) == (128, 128, 128)


def test_max_tokens_overrides_the_model_canvas() -> None:
    params = parse(BODY | {"max_tokens": 64}, 32)
    assert (params.gen_length, params.steps) == (64, 64)


def _checkpoint(tmp_path: Path, max_new_tokens: object) -> Path:
    path = write_tiny("llada", tmp_path / "ckpt", d_model=32, n_layers=1, n_heads=2,
                      mlp_hidden_size=32)  # fmt: skip
    gen_path = path / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    if max_new_tokens is not None:
        gen["max_new_tokens"] = max_new_tokens
    gen_path.write_text(json.dumps(gen))
    return path


def test_loader_reads_max_new_tokens_and_engine_exposes_it(tmp_path: Path) -> None:
    loaded = load_model(str(_checkpoint(tmp_path, 24)), device="cpu", dtype="float32")
    assert loaded.default_gen_length == 24
    assert AsyncEngine(loaded).default_gen_length == 24


def test_checkpoint_without_max_new_tokens_keeps_128(tmp_path: Path) -> None:
    loaded = load_model(str(_checkpoint(tmp_path, None)), device="cpu", dtype="float32")
    assert loaded.default_gen_length is None
    assert AsyncEngine(loaded).default_gen_length == 128


@pytest.mark.parametrize("bad", [0, -3, "32", 2.5, True])
def test_invalid_max_new_tokens_is_a_load_error(tmp_path: Path, bad: object) -> None:
    with pytest.raises(ModelLoadError, match="max_new_tokens must be a positive integer"):
        load_model(str(_checkpoint(tmp_path, bad)), device="cpu", dtype="float32")


def _with_gen(tmp_path: Path, **gen_fields: object) -> Path:
    path = _checkpoint(tmp_path, None)
    gen_path = path / "generation_config.json"
    gen_path.write_text(json.dumps(json.loads(gen_path.read_text()) | gen_fields))
    return path


@pytest.mark.parametrize(
    ("gen_fields", "block"),
    [
        ({"block_length": 16, "max_new_tokens": 64}, 16),  # the model's own block
        ({"max_new_tokens": 24}, 24),  # else the canvas it was trained on (our demos)
        ({}, None),  # else none: one block, as before
    ],
)
def test_loader_reads_the_recommended_block(
    tmp_path: Path, gen_fields: dict, block: int | None
) -> None:
    loaded = load_model(str(_with_gen(tmp_path, **gen_fields)), device="cpu", dtype="float32")
    assert loaded.default_block_length == block
    assert loaded.vocab_size == loaded.config["vocab_size"]


def test_invalid_block_length_is_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="block_length must be a positive integer"):
        load_model(str(_with_gen(tmp_path, block_length=0)), device="cpu", dtype="float32")


def test_demo_models_recommend_blocks_of_32() -> None:
    for name in ("demo-llada", "demo-idlm"):
        assert load_model(name, device="cpu", dtype="float32").default_block_length == 32
