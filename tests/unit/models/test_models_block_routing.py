"""LLaDA2.2 block routing (``expert_capacity``; models/routing.py) against a per-block
re-statement in plain torch: per routing block (one request's tokens whose positions fall in
one block aligned to position 0) the experts admitted are the C best by the max over the
block's tokens of the biased sigmoid score; each token then takes its top-k among them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dllm_serve.decoding.protocol import AttentionKind, RowSpec
from dllm_serve.engine.model_runner import ModelRunner
from dllm_serve.models.loader import load_model
from dllm_serve.models.moe import MoE
from dllm_serve.models.routing import (
    route,
    routing_segments,
    routing_segments_padded,
    sigmoid_group_limited,
)
from dllm_serve.models.transformer_config import MoEConfig
from dllm_serve_train.tiny_checkpoints import write_tiny_llada2

D = 16


def capacity_config(
    capacity: int | None, experts: int = 8, k: int = 2, block: int = 4
) -> MoEConfig:
    return MoEConfig(
        num_experts=experts, top_k=k, expert_hidden_size=6, shared_hidden_size=6,
        routed_scaling_factor=2.5, expert_capacity=capacity, routing_block=block,
    )  # fmt: skip


def swiglu(mlp: torch.nn.Module, v: torch.Tensor) -> torch.Tensor:
    gate, up = v @ mlp.gate_proj.weight.T, v @ mlp.up_proj.weight.T
    return (torch.nn.functional.silu(gate) * up) @ mlp.down_proj.weight.T


def layer_for(cfg: MoEConfig, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    layer = MoE(D, cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return layer


# Three requests' rows in one flat batch (routing block 4): a row starting mid-block (5..14),
# one from position 0 (0..6) and one on a block boundary (8..15).
ROWS = [(5, 10), (0, 7), (8, 8)]


def flat_rows() -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.cat([torch.arange(s, s + n) for s, n in ROWS])
    offsets = torch.tensor([0, 10, 17])
    return positions, offsets


def restated(layer: MoE, x: torch.Tensor) -> tuple[torch.Tensor, list[set[int]]]:
    """The layer by the rule, one routing block at a time: outputs and each block's experts."""
    cfg = layer.cfg
    assert cfg.expert_capacity is not None
    out = torch.zeros_like(x)
    used: list[set[int]] = []
    offset = 0
    for start, n in ROWS:
        tokens = list(range(offset, offset + n))
        offset += n
        blocks: dict[int, list[int]] = {}
        for i, t in enumerate(tokens):
            blocks.setdefault((start + i) // cfg.routing_block, []).append(t)
        for members in blocks.values():
            s = (x[members] @ layer.router.weight.T).sigmoid()
            b = s + layer.router.expert_bias
            g = b.max(0).values
            admitted = sorted(range(cfg.num_experts), key=lambda j: -float(g[j]))
            admitted = admitted[: cfg.expert_capacity]
            experts: set[int] = set()
            for row, t in enumerate(members):
                chosen = sorted(admitted, key=lambda j: -float(b[row, j]))[: cfg.top_k]
                experts.update(chosen)
                w = s[row, chosen] / s[row, chosen].sum() * cfg.routed_scaling_factor
                out[t] = sum(
                    wi * swiglu(layer.experts[e], x[t]) for wi, e in zip(w, chosen, strict=True)
                )
                out[t] += swiglu(layer.shared, x[t])
            used.append(experts)
    return out, used


@torch.no_grad()
def test_batched_layer_equals_the_per_block_restatement() -> None:
    cfg = capacity_config(3)
    layer = layer_for(cfg)
    x = torch.randn(sum(n for _, n in ROWS), D)
    positions, offsets = flat_rows()
    got = layer(x, routing_segments(positions, offsets, cfg.routing_block))
    want, used = restated(layer, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert all(len(experts) <= 3 for experts in used)
    # Fused (the grouped path) gives the same outputs.
    layer.fuse()
    torch.testing.assert_close(layer(x, routing_segments(positions, offsets, 4)), got)


@torch.no_grad()
def test_a_block_is_restricted_to_its_admitted_experts() -> None:
    cfg = capacity_config(2)
    layer = layer_for(cfg, seed=1)
    x = torch.randn(4, D) * 3
    logits = x @ layer.router.weight.T
    bias = layer.router.expert_bias
    free = sigmoid_group_limited(logits, bias, capacity_config(None))[1]
    assert len(set(free.flatten().tolist())) > 2  # ordinary routing would use more experts
    weights, ids = route(logits, bias, cfg, torch.zeros(4, dtype=torch.long))
    assert len(set(ids.flatten().tolist())) == 2  # one block, capacity 2, top-2: the pool
    # Each token in its own block: the admission is its own top-2, i.e. ordinary routing.
    alone = route(logits, bias, cfg, torch.arange(4))[1]
    assert alone.sort(-1).values.tolist() == free.sort(-1).values.tolist()
    torch.testing.assert_close(weights.sum(-1), torch.full((4,), 2.5))


@pytest.mark.parametrize("experts", [8, 12])
def test_a_capacity_of_every_expert_is_ordinary_routing(experts: int) -> None:
    gen = torch.Generator().manual_seed(experts)
    logits = torch.randn(20, experts, generator=gen) * 2
    bias = torch.randn(experts, generator=gen) * 0.3
    segments = torch.arange(20) // 5
    want_w, want_ids = sigmoid_group_limited(logits, bias, capacity_config(None, experts, 3))
    got_w, got_ids = route(logits, bias, capacity_config(experts, experts, 3), segments)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w)


def test_routing_blocks_start_at_rows_and_block_boundaries() -> None:
    positions, offsets = flat_rows()
    ids = routing_segments(positions, offsets, 4).tolist()
    # Row 5..14: [5-7] [8-11] [12-14]; row 0..6: [0-3] [4-6]; row 8..15: [8-11] [12-15].
    assert ids == [0] * 3 + [1] * 4 + [2] * 3 + [3] * 4 + [4] * 3 + [5] * 4 + [6] * 4
    # A row that starts mid-block right after another row's tokens of that block (same
    # positions' block): still its own routing block.
    assert routing_segments(torch.tensor([4, 5, 6, 7]), torch.tensor([0, 2]), 4).tolist() == [
        0, 0, 1, 1,
    ]  # fmt: skip
    padded = routing_segments_padded(torch.tensor([[0, 1, 2, 3, 4], [2, 3, 4, 5, 6]]), 4)
    assert padded.tolist() == [0, 0, 0, 0, 1, 2, 2, 3, 3, 3]


def test_block_routing_needs_the_blocks() -> None:
    cfg = capacity_config(3)
    with pytest.raises(ValueError, match="routing blocks"):
        route(torch.zeros(2, 8), torch.zeros(8), cfg)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"expert_capacity": 1}, "expert_capacity 1 must be in"),
        ({"expert_capacity": 9}, "expert_capacity 9 must be in"),
        ({"routing_block": 0}, "routing block"),
        ({"routing": "softmax"}, "needs sigmoid routing"),
    ],
)
def test_inconsistent_capacities_refused(change: dict, match: str) -> None:
    base = {"num_experts": 8, "top_k": 2, "expert_hidden_size": 4, "shared_hidden_size": 4,
            "expert_capacity": 3, "routing_block": 4}  # fmt: skip
    with pytest.raises(ValueError, match=match):
        MoEConfig(**{**base, **change})


# ---- in the model, through the engine's flat batch ----------------------------------------------


@torch.no_grad()
def test_flat_batch_of_several_requests_equals_each_alone(tmp_path: Path) -> None:
    """A prefill row and two decode rows of different requests in one forward: each row's
    logits equal its own padded, block-causal forward (the routing blocks never mix
    requests), and the capacity matters (the same weights routed per token differ)."""
    path = write_tiny_llada2(tmp_path / "m", block_size=4, seed=2, levenshtein=True)
    loaded = load_model(str(path), device="cpu", dtype="float32")
    model, b = loaded.model, 4
    runner = ModelRunner(model, torch.device("cpu"), kv_slots=256)
    pool = runner.pool
    assert pool is not None
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 700, (n,), generator=gen).tolist() for n in (8, 12, 6)]
    rows, wants = [], []
    for tokens, start in zip(seqs, (0, 8, 4), strict=True):
        kv = pool.reserve(start + len(tokens) if start == 0 else len(tokens))
        assert kv is not None
        if start:  # a decode row: its prefix's K/V first, by a prefill of its own
            head = tokens[:start]
            runner.run([RowSpec(head, 0, [start - 1], AttentionKind.BLOCK_CAUSAL, kv=kv, block=b)])
            kv.length = start
        own = tokens[start:] if start else tokens
        kind = AttentionKind.BLOCK_CAUSAL if start == 0 else AttentionKind.BIDIRECTIONAL
        rows.append(RowSpec(own, start, list(range(len(own))), kind, kv=kv, block=b))
        pos = torch.arange(len(tokens))
        allowed = (pos[None, :] // b) <= (pos[:, None] // b)
        hidden = model(torch.tensor([tokens]), pos[None], allowed[None, None])[0, start:]
        wants.append(model.lm_head(hidden))
    logits = runner.run(rows)
    for r, want in enumerate(wants):
        got = logits.row(r) if hasattr(logits, "row") else logits[r, : want.shape[0]]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # Per-token routing of the same weights answers differently: the capacity is in effect.
    for layer in model.layers:
        if isinstance(layer.mlp, MoE):
            layer.mlp.cfg = layer.mlp.router.cfg = replace(layer.mlp.cfg, expert_capacity=None)
    model.config = replace(model.config, moe=replace(model.config.moe, expert_capacity=None))
    tokens = seqs[0]
    pos = torch.arange(len(tokens))
    allowed = (pos[None, :] // b) <= (pos[:, None] // b)
    free = model.lm_head(model(torch.tensor([tokens]), pos[None], allowed[None, None])[0])
    assert not torch.allclose(free, wants[0], atol=1e-4)
