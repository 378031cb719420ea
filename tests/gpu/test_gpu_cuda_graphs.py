"""Captured CUDA graphs replay exactly the eager tokens (fp32, TF32 off; run with ``-m gpu``).

The same cases as tests/unit/engine/test_engine_cuda_graphs.py, whose static forwards run
uncaptured on CPU: here the engine captures real graphs (``EngineConfig.cuda_graph``, the
default on CUDA) and is compared with ``--no-cuda-graph`` (``cuda_graph=False``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dllm_serve.config import EngineConfig
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.llm import LLM
from dllm_serve.models.loader import LoadedModel, load_model
from dllm_serve.models.lora import attach_draft_lora
from dllm_serve.models.tiny import write_tiny

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
PROMPTS = [
    [{"role": "user", "content": text}]
    for text in ("What is 12 + 30?", "Hi", "Reverse the word cat, please.", "a b c d e f g")
]
CASES = {
    "llada prefix cache": ("llada", DecodingParams(gen_length=32, block_length=8, steps=16),
                           {"kv_cache": "prefix"}),
    "llada prefix cache, seeded": ("llada", DecodingParams(gen_length=16, block_length=8,
                                   steps=16, temperature=0.8, seed=3), {"kv_cache": "prefix"}),
    "idlm rounds": ("idlm", DecodingParams(gen_length=24), {"isd_stride": 4}),
    "sdar blocks": ("sdar", DecodingParams(gen_length=24), {}),
    "tri-mode linear_spec (draft LoRA)": ("nemotron", DecodingParams(gen_length=24,
                                          decoding_mode="linear_spec"), {}),
}  # fmt: skip


@pytest.fixture(autouse=True)
def no_tf32() -> Iterator[None]:
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = Path(tmp_path_factory.mktemp("graphs"))
    out = {family: write_tiny(family, root / family) for family in ("idlm", "sdar")}
    out["nemotron"] = write_tiny("nemotron", root / "nemotron", block_size=8, seed=1,
                                 draft_lora_out=root / "lora")  # fmt: skip
    return out


def load(family: str, paths: dict[str, Path]) -> LoadedModel:
    name = "tiny-llada" if family == "llada" else str(paths[family])
    loaded = load_model(name, device="cuda", dtype="float32")
    if family == "nemotron":
        assert attach_draft_lora(loaded.model, paths[family].parent / "lora") == 2
    return loaded


def generate(loaded: LoadedModel, params: DecodingParams, graphs: bool, **engine: object):
    config = EngineConfig(max_waiting_requests=64, cuda_graph=graphs, **engine)  # type: ignore[arg-type]
    with LLM.from_loaded(loaded, config) as llm:
        out = [(c.text, c.nfe) for c in llm.generate(PROMPTS, params)]
        runner = llm.engine.runner
        captured = sum(s.graph is not None for s in runner.graphs.graphs.values()) if graphs else 0
        replays = runner.graphs.replays if graphs else 0
        return out, captured, replays


@pytest.mark.parametrize("case", list(CASES))
def test_graph_replay_gives_the_eager_tokens(paths: dict[str, Path], case: str) -> None:
    family, params, engine = CASES[case]
    loaded = load(family, paths)
    want, _, _ = generate(loaded, params, graphs=False, **engine)
    got, captured, replays = generate(loaded, params, graphs=True, **engine)
    assert captured > 0 and replays > 0, "no graph was captured and replayed"
    assert got == want
