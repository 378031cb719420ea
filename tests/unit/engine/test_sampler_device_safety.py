"""The batched samplers keep to the device: no implicit host tensor, no hidden read-back.

A step's sampler runs on the logits' device and hands the engine one tensor, which the engine
copies to the host once (``.tolist()``). On CUDA an op mixing in a host tensor either fails (a
CPU operand) or copies it over on every step (a CPU index), neither of which shows on CPU. So
each decoding mode's ``sample`` calls are recorded through the engine on CPU and replayed on
PyTorch's meta device (shapes, no data: a value read raises), under a dispatch mode that fails
an op handed a host tensor; explicit transfers (the per-step ints, ``.to(device)``) are the
allowed exception. Greedy only: a request's sampling generator lives on the real device.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from device_guard import DeviceOnly
from test_engine_cuda_graphs import PROMPTS, tiny_models

from dllm_serve.config import EngineConfig
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.llm import LLM
from dllm_serve.models.loader import LoadedModel

META = torch.device("meta")
pytestmark = pytest.mark.usefixtures("one_thread")


def record_sample_calls(
    loaded: LoadedModel,
    params: DecodingParams | list[DecodingParams],
    limit: int,
    **engine: object,
) -> tuple[Any, list[tuple[list[Any], tuple[int, ...]]]]:
    """The engine's algorithm and its first ``limit`` sample calls (states, logits shape)."""
    calls: list[tuple[list[Any], tuple[int, ...]]] = []
    config = EngineConfig(max_waiting_requests=64, **engine)  # type: ignore[arg-type]
    with LLM.from_loaded(loaded, config) as llm:
        algorithm = llm.engine.algorithm
        sample = algorithm.sample

        def recording(states: list[Any], logits: torch.Tensor) -> torch.Tensor:
            if len(calls) < limit:
                calls.append((copy.deepcopy(list(states)), tuple(logits.shape)))
            return sample(states, logits)

        algorithm.sample = recording
        try:
            llm.generate(PROMPTS, params)
        finally:
            del algorithm.sample
    return algorithm, calls


CASES = {
    "llada top-k": ("llada", DecodingParams(gen_length=16, block_length=8, steps=8), {}),
    "llada threshold": ("llada", DecodingParams(gen_length=16, block_length=8, steps=8,
                        confidence_threshold=0.5), {}),
    "llada LocalLeap": ("llada", DecodingParams(gen_length=16, block_length=8, steps=8,
                        use_local_leap=True), {}),
    "llada entropy confidence": ("llada", DecodingParams(gen_length=16, block_length=8, steps=8,
                                 confidence_metric="entropy_inverse"), {}),
    "llada prefix cache": ("llada", DecodingParams(gen_length=16, block_length=8, steps=8),
                           {"kv_cache": "prefix"}),
    "idlm rounds": ("idlm", DecodingParams(gen_length=16), {"isd_stride": 4}),
    "sdar blocks": ("sdar", DecodingParams(gen_length=16), {}),
    "tri-mode linear_spec": ("nemotron", DecodingParams(gen_length=16,
                             decoding_mode="linear_spec"), {}),
    "tri-mode ar": ("nemotron", DecodingParams(gen_length=16, decoding_mode="ar"), {}),
    # Rows under different rules share one step: the per-row rule masks are built then.
    "llada mixed rules": ("llada", [
        DecodingParams(gen_length=16, block_length=8, steps=8),
        DecodingParams(gen_length=16, block_length=8, steps=8, confidence_threshold=0.5),
        DecodingParams(gen_length=16, block_length=8, steps=8, use_local_leap=True),
        DecodingParams(gen_length=16, block_length=8, steps=8,
                       confidence_metric="entropy_inverse"),
    ], {}),
    "tri-mode mixed modes": ("nemotron", [
        DecodingParams(gen_length=16, decoding_mode=mode)
        for mode in ("linear_spec", "ar", "diffusion", "linear_spec")
    ], {}),
}  # fmt: skip


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoadedModel]:
    return tiny_models(Path(tmp_path_factory.mktemp("sampler-safety")), "cpu")


@pytest.mark.parametrize("case", list(CASES))
def test_samplers_keep_to_the_device(models: dict[str, LoadedModel], case: str) -> None:
    family, params, engine = CASES[case]
    algorithm, calls = record_sample_calls(models[family], params, limit=16, **engine)
    assert calls, "no sample call was recorded: the test would be vacuous"
    for states, shape in calls:
        logits = torch.empty(shape, device=META)
        with DeviceOnly(META, allow_transfers=True) as guard:
            out = algorithm.sample(states, logits)
        assert out.device == META and guard.ops > 0
