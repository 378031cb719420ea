"""The fused MoE layer's grouped forward (models/moe.py): the experts' weights stacked, every
expert's run in two ``torch._grouped_mm`` calls, nothing read back to the host; and the
one-by-one fallback where the grouped op is refused."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch
from test_models_moe import moe_config

from dllm_serve.models import moe as moe_module
from dllm_serve.models.moe import MoE

SHAPES = [(8, 2, 1, 2), (16, 4, 2, 3), (32, 8, 4, 8)]  # (experts, groups, kept groups, top_k)
needs_grouped_mm = pytest.mark.skipif(
    not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm"
)


def layer(shape: tuple[int, int, int, int], seed: int) -> MoE:
    torch.manual_seed(seed)
    cfg = moe_config(shape)
    cfg = type(cfg)(**{**cfg.__dict__, "expert_hidden_size": 24, "shared_hidden_size": 24})
    moe = MoE(64, cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return moe.eval()


@pytest.fixture(autouse=True)
def fresh_log() -> Iterator[None]:
    """Refusals are logged once per cause in a process: start every test afresh."""
    moe_module._LOGGED_REFUSALS.clear()
    yield
    moe_module._LOGGED_REFUSALS.clear()


@needs_grouped_mm
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@torch.no_grad()
def test_the_grouped_forward_equals_the_experts_one_by_one_bitwise(
    shape: tuple[int, int, int, int],
) -> None:
    moe = layer(shape, seed=sum(shape))
    x = torch.randn(3, 37, 64)
    unfused = moe(x)  # per-expert modules, separate gate and up projections
    moe.fuse()
    assert moe.gate_up is not None and moe.down is not None and len(moe.experts) == 0
    assert moe.gate_up.shape == (shape[0], 64, 2 * 24) and moe.down.shape == (shape[0], 24, 64)
    moe.grouped_refused = True
    one_by_one = moe(x)  # the fused experts, one matmul each (the fallback)
    moe.grouped_refused = False
    # Fusing gate and up rounds differently from two projections: close, not equal.
    torch.testing.assert_close(one_by_one, unfused, rtol=1e-5, atol=1e-5)
    calls = []
    grouped_mm = torch._grouped_mm

    def counting(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return grouped_mm(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "_grouped_mm", counting)
        grouped = moe(x)
    assert len(calls) == 2, "the fused layer did not take the grouped path"
    assert torch.equal(grouped, one_by_one)


@torch.no_grad()
def test_a_refused_grouped_op_falls_back_to_the_experts_one_by_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    x = torch.randn(2, 9, 64)
    accepted = layer(SHAPES[0], seed=1)
    accepted.fuse()
    want = accepted(x)

    def refuse(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("Expected inputs of BF16 type but got mat_a.dtype=torch.float32")

    moe = layer(SHAPES[0], seed=1)
    with pytest.MonkeyPatch.context() as mp, caplog.at_level(logging.INFO, "dllm_serve"):
        mp.setattr(torch, "_grouped_mm", refuse)
        moe.fuse()  # the load-time check meets the refusal
        first, second = moe(x), moe(x)  # and the forwards never call the op again
    assert torch.equal(first, want) and torch.equal(second, want)
    assert moe.grouped_refused
    refusals = [r for r in caplog.records if "grouped_mm refuses" in r.getMessage()]
    assert len(refusals) == 1 and "BF16" in refusals[0].getMessage()  # once, with the cause
    other = layer(SHAPES[0], seed=5)
    with pytest.MonkeyPatch.context() as mp, caplog.at_level(logging.INFO, "dllm_serve"):
        mp.setattr(torch, "_grouped_mm", refuse)
        other.fuse()
        other(x)
    assert other.grouped_refused  # each layer learns it; the log said it once
    assert len([r for r in caplog.records if "grouped_mm refuses" in r.getMessage()]) == 1


@pytest.mark.parametrize(
    "fault",
    [
        torch.OutOfMemoryError("CUDA out of memory"),
        torch.AcceleratorError("CUDA error: an illegal memory access was encountered"),
    ],
)
@torch.no_grad()
def test_a_failing_device_is_not_taken_for_a_refusal(fault: RuntimeError) -> None:
    moe = layer(SHAPES[0], seed=2)

    def failing(*args: object, **kwargs: object) -> torch.Tensor:
        raise fault

    with pytest.MonkeyPatch.context() as mp, pytest.raises(type(fault)):
        mp.setattr(torch, "_grouped_mm", failing)
        moe.fuse()
    assert not moe.grouped_refused


@torch.no_grad()
def test_expert_parallel_ranks_keep_the_one_by_one_path() -> None:
    """A rank holding some experts returns a partial sum: its picks of the others' experts
    stay zero (the all-reduce completes them), which the grouped runs would not give."""
    shape = SHAPES[0]
    full = layer(shape, seed=3)
    x = torch.randn(2, 6, 64)
    cfg = type(full.cfg)(**{**full.cfg.__dict__, "expert_ranks": (1, 2)})  # experts 4..7
    half = MoE(64, cfg).eval()
    half.router.load_state_dict(full.router.state_dict())
    for i, expert in enumerate(half.experts):
        expert.load_state_dict(full.experts[4 + i].state_dict())
    half.shared = None
    half.fuse()
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1))
        partial = half(x)
    assert not calls
    # The same as the full layer restricted to experts 4..7 (the shared expert left out).
    full.shared = None
    full.fuse()
    full.down.data[:4] = 0  # experts 0..3 contribute nothing
    torch.testing.assert_close(partial, full(x), rtol=1e-6, atol=1e-6)
