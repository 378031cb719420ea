"""Mask lookahead: a diffusion forward includes the active block and at most N masks after it.

With 0, a long canvas is read block by block exactly as a one-block canvas is read, so the
first block's tokens (and an answer that ends in it) do not depend on the canvas length.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from decoding_mock import EOS_ID, EOT_ID, MASK_ID, MockLM, step

from dllm_serve.decoding.canvas import LLaDADenoiser, prefix_spec
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.models.errors import ModelLoadError
from dllm_serve.models.loader import load_model
from dllm_serve_train.tiny_checkpoints import write_tiny

PROMPT = [5, 17, 8, 30, 11]


def _decode(lookahead: int | None, gen: int, block: int, temperature: float = 0.0):
    """Decode to the end, recording each prepared row's token count."""
    denoiser = LLaDADenoiser(MASK_ID, (), mask_lookahead=lookahead)
    params = DecodingParams(
        gen_length=gen, block_length=block, steps=gen, temperature=temperature, seed=3
    )
    state = denoiser.init_state(PROMPT, params, "cpu")
    model, widths = MockLM(seed=4), []
    while not state.finished:
        _, hi = state.active_block
        spec = denoiser.prepare(state)
        widths.append((len(spec.input_ids), hi))
        assert torch.equal(spec.input_ids, state.canvas[: len(spec.input_ids)])
        step(denoiser, state, model)
    return state, widths


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_first_block_is_the_one_block_canvas(temperature: float) -> None:
    one, _ = _decode(0, 8, 8, temperature)
    long, widths = _decode(0, 32, 8, temperature)
    n = len(PROMPT) + 8
    assert long.tokens[:n] == one.tokens[:n]
    assert all(width == hi for width, hi in widths)  # nothing past the active block
    # Without the lookahead the trailing masks change what the first block decodes.
    full, full_widths = _decode(None, 32, 8, temperature)
    assert {w for w, _ in full_widths} == {len(PROMPT) + 32}
    assert full.tokens[:n] != one.tokens[:n]


def test_lookahead_covering_the_canvas_is_the_reference() -> None:
    for temperature in (0.0, 0.8):
        reference, _ = _decode(None, 24, 8, temperature)
        covered, _ = _decode(16, 24, 8, temperature)
        assert covered.tokens == reference.tokens and covered.nfe == reference.nfe
    _, widths = _decode(4, 24, 8)
    total = len(PROMPT) + 24
    assert [w for w, _ in widths] == [min(hi + 4, total) for _, hi in widths]


def test_prefix_cache_rows_stop_at_the_window() -> None:
    denoiser = LLaDADenoiser(MASK_ID, (EOS_ID, EOT_ID), mask_lookahead=2, prefix_cache=True)
    state = denoiser.init_state(PROMPT, DecodingParams(gen_length=16, block_length=4), "cpu")
    state.block = 1  # second block: [9, 13), the cached prefix is [0, 9)
    state.kv = SimpleNamespace(length=len(PROMPT) + 4)
    spec = prefix_spec(state, 0, denoiser.attention)
    assert len(spec.input_ids) == 4 + 2 == state.row_length
    assert spec.positions.tolist() == list(range(9, 15))


def test_negative_lookahead_refused() -> None:
    with pytest.raises(ValueError, match="mask_lookahead must be >= 0"):
        LLaDADenoiser(MASK_ID, (), mask_lookahead=-1)


def test_loader_reads_it_from_generation_config(tmp_path: Path) -> None:
    path = write_tiny("llada", tmp_path / "m")
    gen_path = path / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    assert load_model(str(path), device="cpu").mask_lookahead is None
    gen_path.write_text(json.dumps(gen | {"mask_lookahead": 0}))
    assert load_model(str(path), device="cpu").mask_lookahead == 0
    gen_path.write_text(json.dumps(gen | {"mask_lookahead": -2}))
    with pytest.raises(ModelLoadError) as err:
        load_model(str(path), device="cpu")
    assert str(err.value) == f"{gen_path}: mask_lookahead must be a non-negative integer: -2"
