"""Tensor parallelism (Megatron-style) of the dense decoder over ``torch.distributed``.

Each of ``size`` ranks holds one shard of every layer and they run every forward together:

- **attention**: the q/k/v projections are column-parallel by heads (rank ``r`` holds query
  heads ``r·H/N …``); when there are fewer KV heads than ranks each KV head is replicated on
  the ``N / H_kv`` ranks whose query heads read it (SGLang does the same for LLaDA2's 4 KV
  heads), so GQA stays local; ``o_proj`` is row-parallel: each rank's product is a partial
  sum, **all-reduced** (its bias, if any, is added on rank 0 only);
- **MLP**: gate/up column-parallel, down row-parallel, all-reduced;
- **embedding**: vocab-parallel rows; ids outside a rank's rows embed to zero, all-reduced;
- **LM head**: vocab-parallel rows, so each rank computes the logits of its vocabulary slice
  (which stay there: the sampler reduces them per rank, ``engine/vocab_parallel.py``).

- **mixture of experts**: the router is replicated (every rank routes every token the same
  way); the shared expert is sliced like the dense MLP; the routed experts are either split
  over the ranks (**expert parallelism**: rank ``r`` holds experts ``r·E/N …`` whole and runs
  the tokens routed to them) or each sliced like the MLP. Either way each rank's output is a
  partial sum completed by the same all-reduce. Attention is tensor-parallel, so every rank
  already holds every token's hidden state: dispatching tokens to their experts' rank needs no
  all-to-all (that is needed when attention is data-parallel, which this does not do).

A fused q/k/v tensor (LLaDA2's ``query_key_value``, ``[Q heads | K heads | V heads]``) is cut
into the rank's heads of each part. Norms, RoPE and the KV pool's slot layout are replicated;
each rank's KV pool holds its own KV heads. The weights are read per rank with safetensors
slicing, so a rank's start-up memory is its shard, not the model.
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
    # MoE layers: True splits the experts over the ranks (each holds E / size whole experts);
    # False slices every expert like the dense MLP (each holds 1 / size of each expert).
    expert_parallel: bool = False

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x


def shard_config(
    tcfg: TransformerConfig, size: int, rank: int = 0, expert_parallel: bool = False
) -> TransformerConfig:
    """The shape rank ``rank`` of ``size`` holds (heads, KV heads, MLP width, vocabulary and
    the MoE experts divided as the module docstring says); raises :class:`ModelLoadError`
    naming what does not divide."""
    if size == 1:
        return tcfg
    moe = tcfg.moe
    if expert_parallel and moe is None:
        raise ModelLoadError(
            "expert parallelism (--expert-parallel-size; expert_parallel=True offline) applies "
            "to mixture-of-experts models only"
        )
    sizes = [
        ("attention heads", tcfg.n_heads),
        ("MLP width", tcfg.mlp_hidden_size),
        ("vocabulary rows", tcfg.vocab_size),
    ]
    if moe is not None:
        sizes.append(("shared-expert width", moe.shared_hidden_size))
        sizes.append(
            ("experts", moe.num_experts)
            if expert_parallel
            else ("expert width", moe.expert_hidden_size)
        )
    for what, value in sizes:
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
    if moe is not None:
        moe = dataclasses.replace(
            moe,
            shared_hidden_size=moe.shared_hidden_size // size,
            expert_hidden_size=moe.expert_hidden_size // (1 if expert_parallel else size),
            expert_ranks=(rank, size) if expert_parallel else (0, 1),
        )
    fields: dict[str, Any] = {
        "n_heads": tcfg.n_heads // size,
        "n_kv_heads": max(1, kv // size),
        "mlp_hidden_size": tcfg.mlp_hidden_size // size,
        "vocab_size": tcfg.vocab_size // size,
        "moe": moe,
    }
    # A stack with per-layer attention shapes (DiffusionGemma) divides those itself.
    tp_fields = getattr(tcfg, "tp_fields", None)
    if tp_fields is not None:
        fields.update(tp_fields(size))
    return dataclasses.replace(tcfg, **fields)


def local_name(ours: str, tcfg: TransformerConfig, shard: TPShard) -> str | None:
    """Our parameter ``ours`` as this rank names it: an expert's index is local under expert
    parallelism (None: another rank's expert); every other name is unchanged."""
    if not (shard.expert_parallel and ".mlp.experts." in ours):
        return ours
    head, rest = ours.split(".mlp.experts.", 1)
    index, tail = rest.split(".", 1)
    assert tcfg.moe is not None
    local = dataclasses.replace(tcfg.moe, expert_ranks=(shard.rank, shard.size)).local_experts
    if int(index) not in local:
        return None
    return f"{head}.mlp.experts.{int(index) - local.start}.{tail}"


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
    if shard.expert_parallel and ".mlp.experts." in name:
        return None  # a whole expert of this rank's
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
    if ours.endswith(("qkv_proj.weight", "qkv_proj.bias")):  # fused: [Q heads | K | V]
        hd, q_rows = tcfg.head_dim, tcfg.n_heads * tcfg.head_dim
        kv_rows = tcfg.n_kv_heads * hd
        per_q = q_rows // shard.size
        kv0, per_kv = kv_head_start(tcfg, shard) * hd, max(1, tcfg.n_kv_heads // shard.size) * hd
        parts = [
            (shard.rank * per_q, (shard.rank + 1) * per_q),
            (q_rows + kv0, q_rows + kv0 + per_kv),
            (q_rows + kv_rows + kv0, q_rows + kv_rows + kv0 + per_kv),
        ]
        return torch.cat([view[a:b] for a, b in parts])
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
