"""Prefix reuse under tensor parallelism: the cache's decisions are rank 0's host data and the
workers take the page tables with the rows, so TP = 2 with the cache (the default) answers
token for token as TP = 1 without it, with the prefix hits it should have (I-DLM, and the
tri-mode model with its draft LoRA in ``linear_spec``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dllm_serve.config import EngineConfig
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.engine.outputs import NullObserver
from dllm_serve.llm import LLM
from dllm_serve_train.tiny_checkpoints import write_tiny, write_tiny_nemotron

SYSTEM = "You answer arithmetic questions tersely and never add anything else. " * 6
QUESTIONS = ["What is 2 + 2?", "What is 7 + 5?", "Reverse the word cat.", "Say hi."]


class Hits(NullObserver):
    def __init__(self) -> None:
        self.hits = 0

    def on_prefix_cache(self, queried: int, hit: int) -> None:
        self.hits += hit


def answers(llm: LLM, params: DecodingParams) -> tuple[list[str], int]:
    hits = Hits()
    llm.engine.observer = hits
    chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
             for q in QUESTIONS]  # fmt: skip
    first = llm.generate(chats[:1], params)  # fills the cache
    rest = llm.generate(chats[1:], params)
    # The offline API reports each request's hit as the server's usage does.
    assert sum(c.cached_tokens for c in first + rest) == hits.hits
    return [c.text for c in first + rest], hits.hits


@pytest.mark.parametrize(
    ("family", "backend"),
    [
        ("idlm", "sdpa"),
        # Slow (excluded by default; `pytest -m slow`): keeps the default suite near 10 minutes.
        pytest.param("nemotron", "sdpa", marks=pytest.mark.slow),
        pytest.param("idlm", "flex", marks=pytest.mark.slow),
    ],
)
def test_tp2_with_the_cache_answers_as_tp1_without_it(
    family: str, backend: str, tmp_path: Path
) -> None:
    """SDPA shares hit pages; flex copies them, on every rank (the copies go with the rows)."""
    lora = None
    if family == "nemotron":
        path = write_tiny_nemotron(tmp_path / "n", block_size=4, seed=2,
                                   draft_lora_out=tmp_path / "lora")  # fmt: skip
        lora = str(tmp_path / "lora")
        params = DecodingParams(gen_length=12, decoding_mode="linear_spec")
    else:
        path = write_tiny(family, tmp_path / family, seed=5)
        params = DecodingParams(gen_length=12)
    off = EngineConfig(enable_prefix_caching=False, attention_backend=backend)
    with LLM(str(path), device="cpu", dtype="float32", engine_config=off,
             draft_lora=lora) as llm:  # fmt: skip
        want, none = answers(llm, params)
    on = EngineConfig(attention_backend=backend)
    with LLM(str(path), device="cpu", dtype="float32", tensor_parallel_size=2,
             draft_lora=lora, engine_config=on) as llm:  # fmt: skip
        assert llm.engine.prefix_cache is not None
        assert llm.engine.prefix_cache.copy_hits is (backend == "flex")
        got, hits = answers(llm, params)
    assert got == want and none == 0
    assert hits >= 3 * 64  # the three later requests hit the system prompt's pages at least
