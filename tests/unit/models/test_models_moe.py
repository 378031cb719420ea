"""LLaDA2's mixture of experts (models/moe.py) against the spec, written out in the test."""

from __future__ import annotations

import math

import pytest
import torch
from llada2_reference import reference_route

from dllm_serve.models.moe import MoE, route
from dllm_serve.models.transformer_config import MoEConfig

SHAPES = [  # (num_experts, n_group, topk_group, top_k)
    (8, 2, 1, 2),  # the tiny checkpoint's
    (16, 4, 2, 3),
    (12, 1, 1, 4),  # one group: plain top-k on the biased scores
    (32, 8, 4, 8),  # LLaDA2.0-mini's routing shape, 8× fewer experts per group
]


def moe_config(shape: tuple[int, int, int, int], scale: float = 2.5) -> MoEConfig:
    experts, groups, kept, k = shape
    return MoEConfig(
        num_experts=experts, top_k=k, n_group=groups, topk_group=kept, expert_hidden_size=6,
        shared_hidden_size=6, routed_scaling_factor=scale, first_dense_layers=0,
    )  # fmt: skip


def as_dict(cfg: MoEConfig) -> dict:
    return {
        "num_experts": cfg.num_experts,
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "num_experts_per_tok": cfg.top_k,
        "routed_scaling_factor": cfg.routed_scaling_factor,
    }


def routes(weights: torch.Tensor, ids: torch.Tensor) -> list[dict[int, float]]:
    return [
        {int(e): float(w) for e, w in zip(i_row, w_row, strict=True)}
        for i_row, w_row in zip(ids, weights, strict=True)
    ]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_routing_equals_the_spec_on_random_inputs(shape: tuple[int, int, int, int]) -> None:
    cfg = moe_config(shape)
    gen = torch.Generator().manual_seed(sum(shape))
    logits = torch.randn(64, cfg.num_experts, generator=gen) * 2
    bias = torch.randn(cfg.num_experts, generator=gen) * 0.3
    got = routes(*route(logits, bias, cfg))
    want = reference_route(logits, bias, as_dict(cfg))
    for g, w in zip(got, want, strict=True):
        assert set(g) == set(w)
        for e in w:
            assert g[e] == pytest.approx(w[e], rel=1e-5)
        assert sum(g.values()) == pytest.approx(cfg.routed_scaling_factor, rel=1e-5)


def test_the_bias_picks_experts_but_never_weighs_them() -> None:
    cfg = moe_config((4, 1, 1, 2), scale=2.5)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    s = [1 / (1 + math.exp(-v)) for v in (2.0, 1.0, 0.0, -1.0)]
    # Unbiased, experts 0 and 1 win; a bias of 0.6 on expert 2 (s 0.5 -> 1.1) displaces 1.
    weights, ids = route(logits, torch.zeros(4), cfg)
    assert sorted(ids[0].tolist()) == [0, 1]
    weights, ids = route(logits, torch.tensor([0.0, 0.0, 0.6, 0.0]), cfg)
    got = routes(weights, ids)[0]
    assert set(got) == {0, 2}
    # The weights are the *unbiased* scores of 0 and 2, renormalised, times the scaling.
    assert got[0] == pytest.approx(s[0] / (s[0] + s[2]) * 2.5, rel=1e-6)
    assert got[2] == pytest.approx(s[2] / (s[0] + s[2]) * 2.5, rel=1e-6)


def test_the_bias_can_change_which_group_is_kept() -> None:
    cfg = moe_config((8, 2, 1, 2))
    # Group 0 (experts 0-3) has the best scores; its top-2 sum loses to group 1 only with bias.
    logits = torch.tensor([[3.0, 2.5, -2.0, -2.0, 1.0, 0.5, -2.0, -2.0]])
    weights, ids = route(logits, torch.zeros(8), cfg)
    assert sorted(ids[0].tolist()) == [0, 1]
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.4, 0.4, 0.0, 0.0])
    weights, ids = route(logits, bias, cfg)
    assert sorted(ids[0].tolist()) == [4, 5]  # a whole group dropped by selection alone
    s4, s5 = torch.sigmoid(torch.tensor([1.0, 0.5])).tolist()
    assert routes(weights, ids)[0][4] == pytest.approx(s4 / (s4 + s5) * 2.5, rel=1e-6)
    assert reference_route(logits, bias, as_dict(cfg))[0].keys() == {4, 5}


def test_negative_biased_scores_never_lose_to_a_dropped_group() -> None:
    # Kept-group experts with biased scores below zero must still beat every dropped expert.
    cfg = moe_config((4, 2, 1, 2))
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    bias = torch.tensor([-0.6, -0.7, -0.9, -0.95])  # group 0's top-2 sum wins, all negative
    _, ids = route(logits, bias, cfg)
    assert sorted(ids[0].tolist()) == [0, 1]


@torch.no_grad()
def test_moe_layer_is_routed_experts_plus_the_shared_one() -> None:
    cfg = moe_config((8, 2, 1, 2))
    torch.manual_seed(0)
    layer = MoE(16, cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 5, 16)
    got = layer(x)

    def swiglu(mlp: torch.nn.Module, v: torch.Tensor) -> torch.Tensor:
        gate, up = v @ mlp.gate_proj.weight.T, v @ mlp.up_proj.weight.T
        return (torch.nn.functional.silu(gate) * up) @ mlp.down_proj.weight.T

    flat = x.reshape(-1, 16)
    chosen = reference_route(flat @ layer.router.weight.T, layer.router.expert_bias, as_dict(cfg))
    rows = [
        sum(w * swiglu(layer.experts[e], flat[t]) for e, w in r.items())
        + swiglu(layer.shared, flat[t])
        for t, r in enumerate(chosen)
    ]
    want = torch.stack(rows).view(2, 5, 16)
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
    # A token's output does not depend on the others in the batch (experts gather, not mix).
    torch.testing.assert_close(layer(x[1, 2:3]), got[1, 2:3], rtol=1e-6, atol=1e-6)
    # Fusing each expert's gate/up projections changes nothing.
    layer.fuse()
    torch.testing.assert_close(layer(x), got, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"num_experts": 9}, "multiple of n_group"),
        ({"topk_group": 3}, "topk_group"),
        ({"top_k": 5}, "num_experts_per_tok"),
        ({"n_group": 8}, ">= 2 experts"),
        ({"first_dense_layers": -1}, "first_k_dense_replace"),
    ],
)
def test_inconsistent_routing_shapes_refused(change: dict, match: str) -> None:
    base = {"num_experts": 8, "top_k": 2, "n_group": 2, "topk_group": 1, "expert_hidden_size": 4,
            "shared_hidden_size": 4, "routed_scaling_factor": 1.0,
            "first_dense_layers": 1}  # fmt: skip
    with pytest.raises(ValueError, match=match):
        MoEConfig(**{**base, **change})
