"""A decoding flag for another kind of model is refused at start-up (found by QA: --isd-stride
and --block-size-tiers on LLaDA, --kv-cache prefix on I-DLM and SDAR started silently)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dllm_serve.config import EngineConfig
from dllm_serve.engine.engine import AsyncEngine
from dllm_serve.models.loader import LoadedModel, load_model
from dllm_serve_train.tiny_checkpoints import write_tiny_idlm, write_tiny_sdar


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoadedModel]:
    root = Path(tmp_path_factory.mktemp("flags"))
    return {
        "llada": load_model("tiny-llada", device="cpu", dtype="float32"),
        "idlm": load_model(str(write_tiny_idlm(root / "idlm")), device="cpu", dtype="float32"),
        "sdar": load_model(str(write_tiny_sdar(root / "sdar")), device="cpu", dtype="float32"),
    }


@pytest.mark.parametrize(
    ("model", "config", "message"),
    [
        ("llada", EngineConfig(isd_stride=8), "(canvas-denoising) has no use for --isd-stride"),
        ("llada", EngineConfig(block_size_tiers=((4, 2),)), "--block-size-tiers"),
        ("idlm", EngineConfig(kv_cache="prefix"), "(I-DLM) has no use for --kv-cache"),
        ("sdar", EngineConfig(kv_cache="prefix"), "(block-diffusion) has no use for --kv-cache"),
        ("sdar", EngineConfig(isd_stride=2), "--isd-stride"),
    ],
)
def test_a_flag_the_model_cannot_use_is_refused(
    models: dict[str, LoadedModel], model: str, config: EngineConfig, message: str
) -> None:
    with pytest.raises(ValueError, match="omit the flag") as info:
        AsyncEngine(models[model], config)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("model", "config"),
    [
        ("llada", EngineConfig(kv_cache="prefix")),
        ("idlm", EngineConfig(isd_stride=8, block_size_tiers=((4, 2),))),
        ("sdar", EngineConfig()),
    ],
)
def test_flags_that_apply_are_accepted(
    models: dict[str, LoadedModel], model: str, config: EngineConfig
) -> None:
    AsyncEngine(models[model], config)
