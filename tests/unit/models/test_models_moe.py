"""The mixture of experts (models/moe.py, models/routing.py) against the spec, written out in the
tests: LLaDA2's sigmoid group-limited routing and LLaDA-MoE's softmax top-k."""

from __future__ import annotations

import math

import pytest
import torch
from llada2_reference import reference_route
from lladamoe_reference import reference_route as softmax_reference_route

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


BASE = {"num_experts": 8, "top_k": 2, "n_group": 2, "topk_group": 1, "expert_hidden_size": 4,
        "shared_hidden_size": 4, "routed_scaling_factor": 1.0,
        "first_dense_layers": 1}  # fmt: skip


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
    with pytest.raises(ValueError, match=match):
        MoEConfig(**{**BASE, **change})


# ---- softmax top-k routing (LLaDA-MoE) ---------------------------------------------------------
def softmax_config(experts: int, k: int, renormalize: bool, scale: float = 1.0) -> MoEConfig:
    return MoEConfig(
        routing="softmax", num_experts=experts, top_k=k, expert_hidden_size=6,
        shared_hidden_size=0, renormalize=renormalize, routed_scaling_factor=scale,
    )  # fmt: skip


@pytest.mark.parametrize("renormalize", [False, True], ids=["as-released", "renormalized"])
@pytest.mark.parametrize(("experts", "k"), [(8, 2), (64, 8), (5, 5), (16, 1)])
def test_softmax_routing_equals_the_spec(experts: int, k: int, renormalize: bool) -> None:
    cfg = softmax_config(experts, k, renormalize, scale=1.5)
    gen = torch.Generator().manual_seed(experts + k)
    logits = torch.randn(48, experts, generator=gen) * 2
    got = routes(*route(logits, None, cfg))
    want = softmax_reference_route(logits, k, renormalize, scale=1.5)
    for g, w in zip(got, want, strict=True):
        assert set(g) == set(w)
        for e in w:
            assert g[e] == pytest.approx(w[e], rel=1e-6)
        total = sum(g.values())
        if renormalize or k == experts:
            assert total == pytest.approx(1.5, rel=1e-6)
        else:  # the unchosen experts' probability mass is not given back
            assert total < 1.5


def test_softmax_routing_picks_by_probability_and_keeps_it() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    p = torch.softmax(logits.double(), -1)[0].tolist()
    weights, ids = route(logits, None, softmax_config(4, 2, renormalize=False))
    assert routes(weights, ids)[0] == pytest.approx({1: p[1], 2: p[2]}, rel=1e-6)
    weights, ids = route(logits, None, softmax_config(4, 2, renormalize=True))
    norm = p[1] + p[2]
    assert routes(weights, ids)[0] == pytest.approx({1: p[1] / norm, 2: p[2] / norm}, rel=1e-6)


@torch.no_grad()
def test_softmax_moe_layer_is_routed_experts_plus_the_shared_one() -> None:
    cfg = MoEConfig(
        routing="softmax", num_experts=8, top_k=3, expert_hidden_size=6, shared_hidden_size=5,
        renormalize=False,
    )  # fmt: skip
    torch.manual_seed(1)
    layer = MoE(16, cfg)
    assert layer.router.expert_bias is None  # softmax routing has no selection bias
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(3, 7, 16)
    got = layer(x)

    def swiglu(mlp: torch.nn.Module, v: torch.Tensor) -> torch.Tensor:
        gate, up = v @ mlp.gate_proj.weight.T, v @ mlp.up_proj.weight.T
        return (torch.nn.functional.silu(gate) * up) @ mlp.down_proj.weight.T

    flat = x.reshape(-1, 16)
    chosen = softmax_reference_route(flat @ layer.router.weight.T, 3, renormalize=False)
    rows = [
        sum(w * swiglu(layer.experts[e], flat[t]) for e, w in r.items())
        + swiglu(layer.shared, flat[t])
        for t, r in enumerate(chosen)
    ]
    torch.testing.assert_close(got, torch.stack(rows).view(3, 7, 16).float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer(x[2, 4:5]), got[2, 4:5], rtol=1e-6, atol=1e-6)


def test_a_moe_layer_pattern_picks_the_layers() -> None:
    cfg = MoEConfig(num_experts=4, top_k=1, expert_hidden_size=2, shared_hidden_size=0,
                    routing="softmax", moe_layers=(False, True, False))  # fmt: skip
    assert [cfg.is_moe_layer(i) for i in range(3)] == [False, True, False]
    dense_first = MoEConfig(**{**BASE, "first_dense_layers": 1})
    assert [dense_first.is_moe_layer(i) for i in range(2)] == [False, True]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"n_group": 2}, "softmax routing has no expert groups"),
        ({"top_k": 9}, r"num_experts_per_tok 9 must be in \[1, num_experts 8\]"),
        ({"moe_layers": (True,), "first_dense_layers": 1}, "either moe_layers"),
        ({"routing": "sparsemixer"}, "unknown MoE routing"),
    ],
)
def test_inconsistent_softmax_configs_refused(change: dict, match: str) -> None:
    base = {"num_experts": 8, "top_k": 2, "expert_hidden_size": 4, "shared_hidden_size": 0,
            "routing": "softmax"}  # fmt: skip
    with pytest.raises(ValueError, match=match):
        MoEConfig(**{**base, **change})
