"""Tensor parallelism (Megatron-style) of the dense decoder over ``torch.distributed``.

Each of ``size`` ranks holds one shard of every layer and they run every forward together:

- **attention**: the q/k/v projections are column-parallel by heads (rank ``r`` holds query
  heads ``r·H/N …``); when there are fewer KV heads than ranks each KV head is replicated on
  the ``N / H_kv`` ranks whose query heads read it (SGLang does the same for LLaDA2's 4 KV
  heads), so GQA stays local; ``o_proj`` is row-parallel: each rank's product is a partial
  sum, **all-reduced** (its bias, if any, is added on rank 0 only);
- **MLP**: gate/up column-parallel, down row-parallel, all-reduced;
- **embedding**: vocab-parallel rows; ids outside a rank's rows embed to zero, all-reduced;
- **LM head**: vocab-parallel rows, so each rank computes the logits of its vocabulary slice.

Norms, RoPE and the KV pool's slot layout are replicated; each rank's KV pool holds its own
KV heads. The weights are read per rank with safetensors slicing, so a rank's start-up
memory is its shard, not the model. Mixture-of-experts layers (which need expert
parallelism) and checkpoints with a fused q/k/v tensor are refused with a clear error.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dllm_serve.models.errors import ModelLoadError
from dllm_serve.models.transformer_config import TransformerConfig


@dataclass(frozen=True)
class TPShard:
    """This process's place in a tensor-parallel group: ``rank`` of ``size``; ``group`` is the
    process group of the collectives (None: the default group)."""

    rank: int
    size: int
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x


def shard_config(tcfg: TransformerConfig, size: int) -> TransformerConfig:
    """The shape one rank holds (heads, KV heads, MLP width and vocabulary divided by
    ``size``); raises :class:`ModelLoadError` naming what does not divide."""
    if size == 1:
        return tcfg
    if tcfg.moe is not None:
        raise ModelLoadError(
            "tensor parallelism of mixture-of-experts layers needs expert parallelism, which "
            "is not implemented yet; serve this model with --tensor-parallel-size 1"
        )
    if tcfg.fused_qkv:
        raise ModelLoadError(
            "tensor parallelism of a checkpoint with a fused q/k/v tensor is not implemented "
            "yet; serve this model with --tensor-parallel-size 1"
        )
    for what, value in (
        ("attention heads", tcfg.n_heads),
        ("MLP width", tcfg.mlp_hidden_size),
        ("vocabulary rows", tcfg.vocab_size),
    ):
        if value % size:
            raise ModelLoadError(
                f"--tensor-parallel-size {size} does not divide the model's {what} ({value})"
            )
    kv = tcfg.n_kv_heads
    if kv % size and size % kv:
        raise ModelLoadError(
            f"--tensor-parallel-size {size} and the model's {kv} KV heads: one must divide "
            "the other"
        )
    return dataclasses.replace(
        tcfg,
        n_heads=tcfg.n_heads // size,
        n_kv_heads=max(1, kv // size),
        mlp_hidden_size=tcfg.mlp_hidden_size // size,
        vocab_size=tcfg.vocab_size // size,
    )


def kv_head_start(tcfg: TransformerConfig, shard: TPShard) -> int:
    """The first KV head of ``shard`` (the replicated head when KV heads < ranks)."""
    kv = tcfg.n_kv_heads
    if kv >= shard.size:
        return shard.rank * (kv // shard.size)
    return shard.rank // (shard.size // kv)


def slice_of(
    name: str, full: tuple[int, ...], tcfg: TransformerConfig, shard: TPShard
) -> tuple[int, int, int] | None:
    """``(dim, start, stop)`` of parameter ``name`` (of ``full`` shape) that ``shard``
    holds, or None when every rank holds all of it."""
    rank, size, hd = shard.rank, shard.size, tcfg.head_dim
    leaf = name.rsplit(".", 2)[-2:]  # e.g. ["q_proj", "weight"]
    module = leaf[0]
    if module in ("q_proj", "gate_proj", "up_proj", "embed_tokens", "head"):
        part = full[0] // size
        return 0, rank * part, (rank + 1) * part
    if module in ("k_proj", "v_proj"):
        per_rank = max(1, tcfg.n_kv_heads // size)
        start = kv_head_start(tcfg, shard) * hd
        return 0, start, start + per_rank * hd
    if module in ("o_proj", "down_proj") and leaf[1] == "weight":
        part = full[1] // size
        return 1, rank * part, (rank + 1) * part
    return None  # norms, the o_proj bias (rank 0 adds it: see load_slice)


def load_slice(handle: Any, tensor: str, ours: str, tcfg: TransformerConfig, shard: TPShard):
    """This rank's part of checkpoint ``tensor`` (our parameter ``ours``) from an open
    safetensors ``handle``, reading only that part from disk."""
    view = handle.get_slice(tensor)
    full = tuple(view.get_shape())
    cut = slice_of(ours, full, tcfg, shard)
    if cut is None:
        value = handle.get_tensor(tensor)
        if ours.endswith("o_proj.bias") and shard.rank != 0:
            value = torch.zeros_like(value)  # a row-parallel bias is added once, by rank 0
        return value
    dim, start, stop = cut
    return view[start:stop] if dim == 0 else view[:, start:stop]


def embed_local(embedding: torch.nn.Embedding, ids: torch.Tensor, shard: TPShard) -> torch.Tensor:
    """Vocab-parallel embedding: this rank's rows for its ids, zero for the others, summed
    over the ranks (each id lives on exactly one rank, so the sum is that row, exactly)."""
    rows = embedding.weight.shape[0]
    local = ids - shard.rank * rows
    inside = (local >= 0) & (local < rows)
    x = embedding(local.clamp(0, rows - 1)) * inside.unsqueeze(-1).to(embedding.weight.dtype)
    return shard.all_reduce(x)


def gather_vocab(local: torch.Tensor, shard: TPShard) -> torch.Tensor | None:
    """Every rank's vocabulary slice of the logits ``[..., V / N]``, concatenated on rank 0
    (``[..., V]``); None on the other ranks."""
    parts = [torch.empty_like(local) for _ in range(shard.size)] if shard.rank == 0 else None
    dist.gather(local.contiguous(), parts, dst=0, group=shard.group)
    return torch.cat(parts, dim=-1) if parts is not None else None
