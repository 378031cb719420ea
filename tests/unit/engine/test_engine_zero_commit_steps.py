"""More top-k steps per block than positions, through the engine (found by QA: a 500 that
also failed every request batched with it), and a row the packer would refuse failing alone."""

from __future__ import annotations

import asyncio

import pytest

from dllm_serve.config import EngineConfig
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.decoding.protocol import RowSpec
from dllm_serve.engine.engine import AsyncEngine
from dllm_serve.engine.outputs import RequestOutput
from dllm_serve.models.loader import LoadedModel, load_model

PROMPT = [11, 12, 13, 14, 15]
PLAIN = DecodingParams(gen_length=16, steps=16, block_length=8, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model("tiny-llada", device="cpu", dtype="float32")


def run_together(engine: AsyncEngine, params: list[DecodingParams]) -> list[list[RequestOutput]]:
    async def go() -> list[list[RequestOutput]]:
        async def one(p: DecodingParams) -> list[RequestOutput]:
            return [o async for o in engine.generate(PROMPT, p)]

        with engine.submitting_together():
            streams = [one(p) for p in params]
        return await asyncio.gather(*streams)

    engine.start()
    try:
        return asyncio.run(go())
    finally:
        engine.shutdown()


@pytest.mark.parametrize("schedule", ["uniform", "front_loaded", "cosine"])
def test_more_steps_than_positions_finish_beside_other_requests(
    loaded: LoadedModel, schedule: str
) -> None:
    many = DecodingParams(
        gen_length=16, steps=18, block_length=8, ignore_eos=True, block_schedule=schedule
    )
    alone = run_together(AsyncEngine(loaded, EngineConfig()), [PLAIN])[0]
    extra, plain = run_together(AsyncEngine(loaded, EngineConfig()), [many, PLAIN])
    assert extra[-1].finish_reason == "length" and extra[-1].completion_tokens == 16
    # Trailing empty steps are skipped (uniform, front_loaded), leading ones are forwards.
    assert extra[-1].nfe == (18 if schedule == "cosine" else 16)
    # Its batch-mate is untouched: the same answer as alone.
    assert plain[-1].finish_reason == "length"
    assert "".join(o.delta_text for o in plain) == "".join(o.delta_text for o in alone)


def test_a_row_with_nothing_to_score_fails_only_its_request(loaded: LoadedModel) -> None:
    engine = AsyncEngine(loaded, EngineConfig())
    real_prepare = engine.algorithm.prepare
    bad = DecodingParams(gen_length=16, steps=16, block_length=8, seed=99)

    def prepare(state):  # type: ignore[no-untyped-def]
        spec = real_prepare(state)
        if state.params is bad:  # a decoder bug: a row that asks for no logits
            return RowSpec(tokens=spec.tokens, start=spec.start, logits_at=[])
        return spec

    engine.algorithm.prepare = prepare  # type: ignore[method-assign]
    broken, plain = run_together(engine, [bad, PLAIN])
    assert broken[-1].finish_reason == "error"
    assert "at least one requested output" in (broken[-1].error or "")
    assert plain[-1].finish_reason == "length" and plain[-1].completion_tokens == 16
