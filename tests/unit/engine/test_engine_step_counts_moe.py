"""Host cost of a MoE model's step, counted (as ``test_engine_step_counts.py`` does for dense
models): one device→host read per step whatever the batch. The MoE layers' experts run as
grouped GEMMs with their run boundaries counted on the device (``models/moe.py``); the
one-by-one fallback would read each layer's expert counts back."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_engine_step_counts import count_steps, engine_with

from dllm_serve.models.loader import LoadedModel, load_model
from dllm_serve_train.tiny_checkpoints import write_tiny

CASES = {  # family → decoding parameters (a canvas long enough for the counted steps)
    "llada2": {"gen_length": 64},
    "lladamoe": {"gen_length": 64, "steps": 64, "block_length": 16},
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoadedModel]:
    root = Path(tmp_path_factory.mktemp("moe-steps"))
    return {f: load_model(str(write_tiny(f, root / f)), dtype="float32") for f in CASES}


@pytest.mark.parametrize("family", list(CASES))
def test_a_moe_step_syncs_once_whatever_the_batch(
    models: dict[str, LoadedModel], family: str
) -> None:
    loaded = models[family]
    moe_layers = sum(1 for block in loaded.model.layers if hasattr(block.mlp, "router"))
    assert moe_layers >= 1
    for batch in (1, 16):
        for counter in count_steps(engine_with(loaded, batch, "none", **CASES[family])):
            assert counter.num_syncs == 1, counter.syncs
            assert counter.syncs["tolist"] == 1


def test_the_fallback_reads_the_counts_once_per_moe_layer(
    models: dict[str, LoadedModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the grouped path saves, and that the count above could fail."""
    loaded = models["llada2"]
    moe_layers = sum(1 for block in loaded.model.layers if hasattr(block.mlp, "router"))
    layers = [block.mlp for block in loaded.model.layers if hasattr(block.mlp, "router")]
    for layer in layers:
        monkeypatch.setattr(layer, "grouped_refused", True)
    for counter in count_steps(engine_with(loaded, 4, "none", **CASES["llada2"])):
        assert counter.num_syncs == 1 + moe_layers, counter.syncs
