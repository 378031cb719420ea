"""Fixtures shared by the I-DLM decoding tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from dllm_serve.models.loader import LoadedModel, load_model
from dllm_serve_train.tiny_checkpoints import write_tiny_idlm


@pytest.fixture(scope="module")
def idlm(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """A tiny random I-DLM-format checkpoint, loaded in fp32 on CPU."""
    path = write_tiny_idlm(Path(tmp_path_factory.mktemp("idlm")) / "tiny-idlm")
    return load_model(str(path), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """A tiny random Nemotron-Labs-Diffusion checkpoint (block 8) with a tiny draft LoRA next
    to it (``<dir>/../lora``; not attached), loaded in fp32 on CPU."""
    from dllm_serve_train.tiny_checkpoints import write_tiny_nemotron

    root = Path(tmp_path_factory.mktemp("nemotron"))
    path = write_tiny_nemotron(
        root / "tiny-nemotron", block_size=8, seed=1, draft_lora_out=root / "lora"
    )
    return load_model(str(path), device="cpu", dtype="float32")
