"""A traced request's step events carry the confidence each commit was made with: the batched
sampler reports it in the step's one copy, only for traced rows, and tracing changes no token."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from dllm_serve.decoding.blocks import CONFIDENCE_SCALE
from dllm_serve.decoding.canvas import LLaDADenoiser
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.engine.engine import AsyncEngine
from dllm_serve.engine.outputs import RequestOutput
from dllm_serve.models.loader import load_model

MASK = 9


def test_sample_reports_each_masked_positions_top1_probability_after_its_tokens() -> None:
    denoiser = LLaDADenoiser(MASK, stop_ids=[0])
    params = DecodingParams(gen_length=4, steps=4)
    traced = denoiser.init_state([1, 2], params, "cpu")
    plain = denoiser.init_state([1, 2], params, "cpu")
    traced.report_confidence = True
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 12, generator=generator)
    out = denoiser.sample([traced, plain], logits.clone())
    assert out.shape == (2, 8)  # tokens, then confidences, for every row of the batch
    z = logits[0].clone()
    z[:, MASK] = float("-inf")
    top1 = torch.softmax(z, -1).max(-1).values
    expected = (top1 * CONFIDENCE_SCALE).round().long()
    assert torch.equal(out[0, 4:], expected)
    # Untraced batches keep the plain [R, M] result (nothing extra crosses to the host).
    assert denoiser.sample([plain], logits[1:].clone()).shape == (1, 4)
    # The tokens are those of the same step without the report.
    again = denoiser.init_state([1, 2], params, "cpu")
    assert torch.equal(denoiser.sample([again, plain], logits.clone())[:, :4], out[:, :4])


def _run(engine: AsyncEngine, params: DecodingParams, trace: bool) -> list[RequestOutput]:
    outputs: list[RequestOutput] = []
    engine.submit([5, 6, 7, 8], params, outputs.append, trace=trace)
    while not (outputs and outputs[-1].finished):
        engine.step()
    return outputs


def test_trace_events_give_each_commit_its_confidence_and_change_no_token() -> None:
    loaded = load_model("tiny-llada", device="cpu", dtype="float32")
    engine = AsyncEngine(loaded)
    # Driven by hand, step by step; submit only asks whether the engine thread is alive.
    engine._thread = SimpleNamespace(is_alive=lambda: True)  # type: ignore[assignment]
    params = DecodingParams(gen_length=8, steps=8, confidence_threshold=0.2)
    traced = _run(engine, params, trace=True)
    plain = _run(engine, params, trace=False)
    assert "".join(o.delta_text for o in traced) == "".join(o.delta_text for o in plain)
    assert traced[-1].completion_tokens == plain[-1].completion_tokens
    steps = [e for o in traced for e in (o.trace or ()) if e["type"] == "step"]
    assert steps
    for event in steps:
        confidences = event["confidences"]
        assert len(confidences) == len(event["commits"]) >= 1
        assert all(c is not None and 0.0 < c <= 1.0 for c in confidences)
        # The threshold rule: every commit at or above 0.2, except the step's single most
        # confident one when none reaches it.
        below = [c for c in confidences if c < 0.2]
        assert not below or (len(confidences) == 1)
