"""What each tensor-parallel rank holds (no processes needed): shard shapes, which slice of
each tensor, which experts under expert parallelism, and the refusals; DiffusionGemma's
per-layer K/V heads and stacked experts too."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors import safe_open

from dllm_serve.models.checkpoint_files import read_json
from dllm_serve.models.diffusion_gemma import load_gemma_slice
from dllm_serve.models.errors import ModelLoadError
from dllm_serve.models.families import DIFFUSION_GEMMA
from dllm_serve.models.sharding import TPShard, local_name, shard_config, slice_of
from dllm_serve.models.transformer_config import MoEConfig, TransformerConfig
from dllm_serve_train.tiny_checkpoints import write_tiny_diffusion_gemma

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


# ---- DiffusionGemma: per-layer attention shapes and stacked experts ---------------------------


def tiny_gemma(tmp_path, **sizes):
    """The tiny DiffusionGemma's full config (sliding layers: 2 KV heads of 16; the full
    layer: 1 K = V head of 32) and its checkpoint path."""
    path = write_tiny_diffusion_gemma(tmp_path / "dg", canvas_length=16, **sizes)
    return DIFFUSION_GEMMA.transformer_config(read_json(path / "config.json")), path


def test_gemma_shard_divides_each_layers_kv_heads_and_sizes_the_pool(tmp_path) -> None:
    full, _ = tiny_gemma(tmp_path)
    local = shard_config(full, 2, rank=1, expert_parallel=True)
    assert [s.n_kv_heads for s in full.layers] == [2, 2, 2, 1]
    # Sliding: one of the two heads each; full: the single K = V head on both ranks.
    assert [s.n_kv_heads for s in local.layers] == [1, 1, 1, 1]
    assert [s.head_dim for s in local.layers] == [s.head_dim for s in full.layers]
    assert (local.n_kv_heads, local.head_dim) == (1, 32)  # the widest local layer's K/V
    assert (local.n_heads, local.vocab_size, local.mlp_hidden_size) == (2, 384, 48)
    assert local.moe is not None and local.moe.local_experts == range(4, 8)


def test_gemma_refuses_kv_heads_that_do_not_divide(tmp_path) -> None:
    full, _ = tiny_gemma(tmp_path, n_heads=6, n_kv_heads=3, d_model=48)
    with pytest.raises(ModelLoadError, match="layer 0's 3 KV heads"):
        shard_config(full, 2)


def test_gemma_slices_heads_and_each_experts_gate_and_up_rows(tmp_path) -> None:
    full, path = tiny_gemma(tmp_path)
    moe = full.moe
    assert moe is not None
    i = moe.expert_hidden_size
    with safe_open(str(path / "model.safetensors"), "pt") as f:

        def get(name, ours, shard):
            return load_gemma_slice(f, f"model.decoder.{name}", ours, full, shard)

        rank1, ep1 = TPShard(1, 2), TPShard(1, 2, expert_parallel=True)
        whole = f.get_tensor("model.decoder.layers.0.experts.gate_up_proj")  # [E, 2I, D]
        sliced = get("layers.0.experts.gate_up_proj", "layers.0.experts.gate_up_proj", rank1)
        half = i // 2
        assert torch.equal(sliced, torch.cat((whole[:, half:i], whole[:, i + half :]), dim=1))
        assert torch.equal(
            get("layers.0.experts.gate_up_proj", "layers.0.experts.gate_up_proj", ep1),
            whole[4:],
        )
        down = f.get_tensor("model.decoder.layers.0.experts.down_proj")  # [E, D, I]
        got = get("layers.0.experts.down_proj", "layers.0.experts.down_proj", rank1)
        assert torch.equal(got, down[:, :, half:])
        k_sliding = f.get_tensor("model.decoder.layers.0.self_attn.k_proj.weight")
        assert torch.equal(
            get("layers.0.self_attn.k_proj.weight", "layers.0.self_attn.k_proj.weight", rank1),
            k_sliding[16:],
        )
        k_full = f.get_tensor("model.decoder.layers.3.self_attn.k_proj.weight")  # 1 head
        for rank in (0, 1):
            name = "layers.3.self_attn.k_proj.weight"
            assert torch.equal(get(name, name, TPShard(rank, 2)), k_full)
        o = f.get_tensor("model.decoder.layers.3.self_attn.o_proj.weight")
        name = "layers.3.self_attn.o_proj.weight"
        assert torch.equal(get(name, name, rank1), o[:, o.shape[1] // 2 :])
        router = f.get_tensor("model.decoder.layers.0.router.proj.weight")
        assert torch.equal(get("layers.0.router.proj.weight", "layers.0.router.proj.weight",
                               ep1), router)  # fmt: skip
