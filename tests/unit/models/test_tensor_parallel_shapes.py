"""What each tensor-parallel rank holds (no processes needed): shard shapes, which slice of
each tensor, which experts under expert parallelism, and the refusals."""

from __future__ import annotations

import dataclasses

import pytest

from dllm_serve.models.errors import ModelLoadError
from dllm_serve.models.sharding import TPShard, local_name, shard_config, slice_of
from dllm_serve.models.transformer_config import MoEConfig, TransformerConfig

DENSE = TransformerConfig(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=1,
                          mlp_hidden_size=48, rope_theta=1e4, rms_norm_eps=1e-5,
                          tie_embeddings=False, max_sequence_length=64)  # fmt: skip
EXPERTS = MoEConfig(num_experts=8, top_k=2, expert_hidden_size=16, shared_hidden_size=16,
                    routing="softmax", renormalize=False)  # fmt: skip
MOE = dataclasses.replace(DENSE, moe=EXPERTS)


def test_dense_shard_divides_heads_mlp_and_vocabulary() -> None:
    local = shard_config(DENSE, 2)
    assert (local.n_heads, local.n_kv_heads, local.mlp_hidden_size, local.vocab_size) == (
        2, 1, 24, 32,
    )  # fmt: skip
    assert local.head_dim == DENSE.head_dim == 8


def test_slices_by_heads_columns_and_replicated_kv_heads() -> None:
    rank1 = TPShard(1, 2)
    assert slice_of("layers.0.attn.q_proj.weight", (32, 32), DENSE, rank1) == (0, 16, 32)
    assert slice_of("layers.0.attn.k_proj.weight", (16, 32), DENSE, rank1) == (0, 8, 16)
    assert slice_of("layers.0.attn.o_proj.weight", (32, 32), DENSE, rank1) == (1, 16, 32)
    assert slice_of("layers.0.mlp.down_proj.weight", (32, 48), DENSE, rank1) == (1, 24, 48)
    assert slice_of("head.weight", (64, 32), DENSE, rank1) == (0, 32, 64)
    assert slice_of("layers.0.attn_norm.weight", (32,), DENSE, rank1) is None
    one_kv = dataclasses.replace(DENSE, n_kv_heads=1)  # 1 KV head, 2 ranks: both hold it
    for rank in (0, 1):
        assert slice_of("layers.0.attn.v_proj.weight", (8, 32), one_kv, TPShard(rank, 2)) == (
            0, 0, 8,
        )  # fmt: skip


def test_expert_parallel_ranks_hold_whole_experts_under_local_names() -> None:
    shard = TPShard(1, 2, expert_parallel=True)
    local = shard_config(MOE, 2, rank=1, expert_parallel=True)
    assert local.moe is not None
    assert local.moe.local_experts == range(4, 8)
    assert local.moe.expert_hidden_size == 16 and local.moe.shared_hidden_size == 8
    name = "layers.0.mlp.experts.{}.gate_proj.weight"
    assert local_name(name.format(5), MOE, shard) == name.format(1)
    assert local_name(name.format(2), MOE, shard) is None
    assert slice_of(name.format(5), (16, 32), MOE, shard) is None  # whole
    sliced = shard_config(MOE, 2, rank=1)  # experts sliced like the MLP instead
    assert sliced.moe is not None and sliced.moe.local_experts == range(8)
    assert sliced.moe.expert_hidden_size == 8
    assert slice_of(name.format(5), (16, 32), MOE, TPShard(1, 2)) == (0, 8, 16)


@pytest.mark.parametrize(
    ("config", "size", "ep", "needle"),
    [
        (DENSE, 3, False, "does not divide the model's attention heads (4)"),
        (dataclasses.replace(DENSE, n_kv_heads=4, n_heads=8, d_model=64), 3, False, "heads"),
        (DENSE, 2, True, "mixture-of-experts models only"),
        (MOE, 16, True, "does not divide"),
    ],
)
def test_refusals_name_what_does_not_divide(config, size, ep, needle) -> None:
    with pytest.raises(ModelLoadError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        shard_config(config, size, expert_parallel=ep)
