"""Host cost of a Fast-dLLM v2 step, counted (as ``test_engine_step_counts.py`` does for the
other modes): one device→host read per step, and a step of 16 rows dispatches exactly the ops
and host-built tensors of a step of one — denoising steps and the write steps that give each
block's first token alike."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from step_counter import StepCounter

from dllm_serve.config import EngineConfig
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.engine.engine import AsyncEngine
from dllm_serve.engine.outputs import IncrementalDetokenizer
from dllm_serve.engine.request import Request
from dllm_serve.models.loader import LoadedModel, load_model
from dllm_serve_train.tiny_checkpoints import write_tiny_fastdllm

B = 8  # one sub-block per block: a prompt of 12 leaves 4 masks, so step 4 is a write


@pytest.fixture(scope="module")
def fastdllm(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = write_tiny_fastdllm(Path(tmp_path_factory.mktemp("fd")) / "f", block_size=B)
    return load_model(str(path), device="cpu", dtype="float32")


def engine_with(loaded: LoadedModel, batch: int, params: DecodingParams) -> AsyncEngine:
    """An engine (thread not started) with ``batch`` running requests of one prompt length."""
    engine = AsyncEngine(loaded, EngineConfig(max_running_requests=64))
    for i in range(batch):
        request = Request(
            request_id=str(i), prompt_ids=[11 + i % 7] * 12, params=params,
            sink=lambda output: None, detokenizer=IncrementalDetokenizer(engine._decode),
        )  # fmt: skip
        engine.scheduler.waiting.append(request)
    engine._admit()
    return engine


def count_steps(engine: AsyncEngine, steps: int) -> list[tuple[str, StepCounter]]:
    """(phase, counts) of ``steps`` steps, each one forward of every row."""
    counts = []
    with torch.inference_mode():
        for _ in range(steps):
            (group,) = engine.scheduler.groups()
            phases = {r.state.phase for r in group}  # type: ignore[union-attr]
            assert len(phases) == 1, "every row in the same phase"
            with StepCounter() as counter:
                engine._forward(group)
            assert engine.num_running == len(group), "no row finished or failed"
            counts.append((phases.pop(), counter))
    return counts


@pytest.mark.parametrize(
    "request_params",
    [{"steps": 64}, {"steps": 64, "confidence_threshold": 0.5}],
    ids=["one-per-step", "threshold"],
)
def test_fastdllm_step_syncs_once_and_ops_do_not_grow_with_the_batch(
    fastdllm: LoadedModel, request_params: dict
) -> None:
    params = DecodingParams(gen_length=64, **request_params)
    solo = count_steps(engine_with(fastdllm, 1, params), 7)
    batch = count_steps(engine_with(fastdllm, 16, params), 7)
    phases = [p for p, _ in solo]
    assert phases == [p for p, _ in batch] == ["prefill", *["decode"] * 4, "write", "decode"]
    for _, counter in [*solo, *batch]:
        assert counter.num_syncs == 1, counter.syncs
        assert counter.syncs["tolist"] == 1
    # Prefill rows are block-causal, one attention group each (the runner's rule for every
    # block-diffusion model); the decode and write steps must not grow with the batch.
    steps = [(s, b) for (phase, s), (_, b) in zip(solo, batch, strict=True) if phase != "prefill"]
    assert [b.num_ops for _, b in steps] == [s.num_ops for s, _ in steps]
    assert [b.host_tensors for _, b in steps] == [s.host_tensors for s, _ in steps]
