"""The prefix cache on CUDA (run with ``-m gpu``): with the flex backend and CUDA graphs (the
GPU defaults; a hit is copied into the request's own pages) and with SDPA (hit pages shared),
requests sharing a system prompt answer token for token as without the cache, and report
their hits. Not run where this was written (no GPU); the same cases pass on CPU
(tests/unit/engine/test_engine_prefix_reuse.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dllm_serve.config import EngineConfig
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.llm import LLM
from dllm_serve.models.loader import load_model
from dllm_serve_train.tiny_checkpoints import write_tiny_idlm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(autouse=True)
def no_tf32() -> Iterator[None]:
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def answers(path: str, device: str, backend: str, on: bool) -> tuple[list[str], list[int]]:
    loaded = load_model(path, device=device, dtype="float32")
    system = list(range(200, 296))  # 96 tokens: six pages
    prompts = [[*system, 300 + i, 400 + i, 500 + i] for i in range(4)]
    params = DecodingParams(gen_length=16, ignore_eos=True)
    config = EngineConfig(
        enable_prefix_caching=on, attention_backend=backend, cuda_graph_max_tokens=128
    )
    with LLM.from_loaded(loaded, config) as llm:
        assert (llm.engine.prefix_cache is not None) is on
        first = llm.generate_ids(prompts[:1], params)  # fills the cache
        rest = llm.generate_ids(prompts[1:], params)
    done = first + rest
    return [c.text for c in done], [c.cached_tokens for c in done]


@pytest.mark.parametrize("backend", ["flex", "sdpa"])
def test_prefix_cache_on_cuda_answers_as_without_it(backend: str, tmp_path: Path) -> None:
    path = str(write_tiny_idlm(tmp_path / "tiny-idlm"))
    off, none = answers(path, "cuda", backend, on=False)
    on, hits = answers(path, "cuda", backend, on=True)
    assert on == off and none == [0] * 4
    assert hits == [0, 96, 96, 96]
