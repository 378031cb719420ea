"""Host cost of a tri-mode engine step, counted: one device→host copy per step in every mode
(prefill, draft, verify, denoise and refresh steps alike), and at T = 0 a step of 16 rows
dispatches no more ops than a step of one (no per-row tensor work)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from step_counter import StepCounter

from dllm_serve.config import EngineConfig
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.engine.engine import AsyncEngine
from dllm_serve.engine.outputs import IncrementalDetokenizer
from dllm_serve.engine.request import Request
from dllm_serve.models.loader import LoadedModel, load_model
from dllm_serve_train.tiny_checkpoints import write_tiny_nemotron

STEPS = 6  # prefill, then draft/verify or denoise/refresh steps


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = write_tiny_nemotron(Path(tmp_path_factory.mktemp("n")) / "n", block_size=4, seed=1)
    return load_model(str(path), device="cpu", dtype="float32")


def counted_steps(loaded: LoadedModel, batch: int, **params: Any) -> list[StepCounter]:
    engine = AsyncEngine(loaded, EngineConfig(max_running_requests=64))
    for i in range(batch):
        engine.scheduler.waiting.append(Request(
            request_id=str(i), prompt_ids=[200 + i % 7] * 6,
            params=DecodingParams(gen_length=32, steps=32, ignore_eos=True, **params),
            sink=lambda output: None, detokenizer=IncrementalDetokenizer(engine._decode),
        ))  # fmt: skip
    engine._admit()
    counts = []
    with torch.inference_mode():
        for _ in range(STEPS):
            groups = engine.scheduler.groups()
            assert len(groups) == 1, "every row in one forward"
            with StepCounter() as counter:
                engine._forward(groups[0])
            assert engine.num_running == batch, "no row finished or failed"
            counts.append(counter)
    return counts


@pytest.mark.parametrize("mode", ["ar", "linear_spec", "diffusion"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_each_mode_syncs_once_per_step(
    nemotron: LoadedModel, mode: str, temperature: float
) -> None:
    params = {"decoding_mode": mode, "temperature": temperature, "seed": 3}
    solo = counted_steps(nemotron, 1, **params)
    batch = counted_steps(nemotron, 16, **params)
    for counter in [*solo, *batch]:
        assert counter.num_syncs == 1, counter.syncs
        assert counter.syncs["tolist"] == 1
    if temperature == 0 and mode == "diffusion":
        assert [c.num_ops for c in batch] == [c.num_ops for c in solo]
    elif temperature == 0 and mode == "linear_spec":
        # Rows that accepted different numbers of drafts have different cached prefixes: the
        # attention group then builds one key-validity mask (a few ops), nothing per row.
        assert max(c.num_ops for c in batch) <= max(c.num_ops for c in solo) + 8
