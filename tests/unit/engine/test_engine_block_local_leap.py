"""LocalLeap on block models with max_tokens below the trained block (found by QA: a 500,
'index 8 is out of bounds', that also failed the top-k requests batched with it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dllm_serve.decoding.params import DecodingParams
from dllm_serve.llm import LLM
from dllm_serve_train.tiny_checkpoints import write_tiny_llada2, write_tiny_sdar

CHAT = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.mark.parametrize(
    ("writer", "block", "short"), [(write_tiny_sdar, 4, 3), (write_tiny_llada2, 32, 8)]
)
def test_local_leap_below_the_block_runs_beside_top_k(
    tmp_path: Path,
    writer,
    block: int,
    short: int,  # type: ignore[no-untyped-def]
) -> None:
    leap = DecodingParams(gen_length=short, steps=block, use_local_leap=True, ignore_eos=True)
    topk = DecodingParams(gen_length=short, steps=block, ignore_eos=True)
    with LLM(str(writer(tmp_path / "m")), device="cpu", dtype="float32") as llm:
        alone = llm.generate([CHAT], topk)[0]
        together = llm.generate([CHAT, CHAT], [leap, topk])
    assert [c.finish_reason for c in together] == ["length", "length"]
    assert together[0].completion_tokens == short
    assert together[1].text == alone.text  # its batch-mate is untouched
