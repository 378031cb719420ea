"""The offline LLM checks what the server checks, up front, as a ValueError (found by QA: a
float gen_length, a mask-token stop id, an id outside the vocabulary or a prompt past the
context failed late as 'generation failed', or ran)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dllm_serve.decoding.params import DecodingParams
from dllm_serve.llm import LLM

PROMPT = [11, 12, 13]


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM("tiny-llada", device="cpu", dtype="float32") as model:
        yield model


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"gen_length": 16.0}, "gen_length must be an integer, got 16.0"),
        ({"gen_length": 16, "steps": 8.5}, "steps must be an integer"),
        ({"gen_length": 16, "seed": "7"}, "seed must be an integer"),
        ({"gen_length": 16, "block_length": True}, "block_length must be an integer"),
    ],
)
def test_decoding_params_take_whole_numbers(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DecodingParams(**fields)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], DecodingParams(gen_length=8, steps=8), "prompt 0 is empty"),
        ([5, 99999], DecodingParams(gen_length=8, steps=8), "outside the vocabulary"),
        ([5, 1011], DecodingParams(gen_length=8, steps=8), "is the mask token"),
        (PROMPT, DecodingParams(gen_length=8, steps=8, stop_token_ids=(1011,)), "mask token"),
        (PROMPT, DecodingParams(gen_length=8, steps=8, stop_token_ids=(-1,)), "vocabulary"),
        ([5] * 2040, DecodingParams(gen_length=16, steps=16), "exceed the model's context"),
    ],
)
def test_generate_refuses_what_the_server_refuses(
    llm: LLM, prompt: list[int], params: DecodingParams, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate_ids([prompt], [params])
    # Nothing was submitted: the engine still answers the next request.
    assert llm.generate_ids([PROMPT], [DecodingParams(gen_length=8, steps=8)])[0].nfe == 8
