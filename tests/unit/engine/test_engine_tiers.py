"""Block-size tiers, and the engine serving a tiny I-DLM checkpoint with ISD."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from dllm_serve.config import EngineConfig
from dllm_serve.decoding.params import BlockSizeTiers, DecodingParams, parse_tiers
from dllm_serve.decoding.selfspec import ISDecoder
from dllm_serve.engine.engine import AsyncEngine
from dllm_serve.engine.outputs import RequestOutput
from dllm_serve.models.loader import LoadedModel, load_model
from dllm_serve_train.tiny_checkpoints import write_tiny_idlm


def test_parse_and_select_tiers() -> None:
    tiers = parse_tiers(" 1:8, 8:4,32:2 ")
    assert tiers == ((1, 8), (8, 4), (32, 2))
    table = BlockSizeTiers(6, tiers)
    assert [table.stride_for(n) for n in (0, 1, 7, 8, 31, 32, 500)] == [6, 8, 8, 4, 4, 2, 2]
    assert table.max_stride == 8  # the KV reservation is sized for this
    assert parse_tiers("") == ()


@pytest.mark.parametrize("text", ["8", "1:x", "1:4,1:2", "4:2,1:3", "1:2,4:3", "0:2", "1:0"])
def test_bad_tiers_are_rejected(text: str) -> None:
    with pytest.raises(ValueError):
        parse_tiers(text)


def test_cli_flags() -> None:
    from dllm_serve.cli import parse_config

    engine = parse_config(["--isd-stride", "3", "--block-size-tiers", "4:2,16:1"]).engine
    assert engine.isd_stride == 3 and engine.block_size_tiers == ((4, 2), (16, 1))
    with pytest.raises(SystemExit):
        parse_config(["--isd-stride", "0"])
    with pytest.raises(SystemExit):
        parse_config(["--block-size-tiers", "1:2,2:4"])


# ---- the engine on a tiny I-DLM checkpoint --------------------------------------------------


@pytest.fixture(scope="module")
def idlm(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = write_tiny_idlm(Path(tmp_path_factory.mktemp("idlm")) / "tiny-idlm")
    return load_model(str(path), device="cpu", dtype="float32")


CASES = [
    ([5, 17, 8, 30, 11], DecodingParams(gen_length=16, steps=16)),
    ([101, 7], DecodingParams(gen_length=12, steps=12, temperature=0.05, seed=3)),
    ([42], DecodingParams(gen_length=10, steps=10, temperature=1.0, seed=9)),
    ([5, 17, 8], DecodingParams(gen_length=14, steps=14, temperature=0.05, seed=4)),
    ([64, 65, 66, 67], DecodingParams(gen_length=8, steps=8)),
    ([9, 9], DecodingParams(gen_length=16, steps=16, temperature=0.05, seed=3)),
]


async def _run(engine: AsyncEngine, prompt: list[int], params: DecodingParams):
    outs: list[RequestOutput] = [o async for o in engine.generate(prompt, params)]
    return "".join(o.delta_text for o in outs), outs[-1]


def _serve(idlm: LoadedModel, config: EngineConfig, cases, concurrent: bool):
    engine = AsyncEngine(idlm, config)
    assert isinstance(engine.algorithm, ISDecoder)
    strides: list[int] = []
    stride_for = engine.algorithm.stride_for
    if stride_for is not None:  # record the stride every round was given

        def recording() -> int:
            strides.append(stride_for())
            return strides[-1]

        engine.algorithm.stride_for = recording
    engine.start()
    try:

        async def main():
            if concurrent:
                return await asyncio.gather(*(_run(engine, p, q) for p, q in cases))
            return [await _run(engine, p, q) for p, q in cases]

        results = asyncio.run(main())
    finally:
        engine.shutdown()
    return [(text, out.completion_tokens, out.finish_reason) for text, out in results], strides


def test_engine_selects_isd_and_batches_match_alone(idlm: LoadedModel) -> None:
    config = EngineConfig(isd_stride=4)
    together, _ = _serve(idlm, config, CASES, concurrent=True)
    alone, _ = _serve(idlm, config, CASES, concurrent=False)
    assert together == alone
    assert all(reason in ("stop", "length") for _, _, reason in together)


def test_tiers_shrink_the_stride_but_not_the_greedy_answer(idlm: LoadedModel) -> None:
    greedy = [(p, DecodingParams(gen_length=q.gen_length, steps=q.steps)) for p, q in CASES]
    plain, _ = _serve(idlm, EngineConfig(isd_stride=4), greedy, concurrent=False)
    tiered_config = EngineConfig(isd_stride=4, block_size_tiers=((3, 2), (5, 1)))
    tiered, strides = _serve(idlm, tiered_config, greedy, concurrent=True)
    assert tiered == plain
    assert {1, 2} <= set(strides)  # 6 concurrent requests: N = 1 at first, 2 as they finish


def test_an_answer_limit_is_refused_outside_canvas_denoising(idlm: LoadedModel) -> None:
    """Only canvas denoising cuts a canvas at ``answer_limit``; elsewhere it would do nothing."""
    engine = AsyncEngine(idlm, EngineConfig())
    params = DecodingParams(gen_length=16, steps=16, answer_limit=9)

    async def submit() -> None:
        engine.generate([5, 17], params)

    with pytest.raises(ValueError, match="answer_limit applies to canvas denoising"):
        asyncio.run(submit())
    assert engine.num_waiting == 0  # nothing was queued
