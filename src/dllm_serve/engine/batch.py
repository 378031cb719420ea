"""Fuse the ForwardSpecs of several requests into one padded forward, and split the logits.

Rows have different lengths (prompt + canvas), attention kinds and logit positions. Each row is
right-padded to the longest one; the attention mask hides padded keys from every real query,
so a row's hidden states are exactly what it would get alone (up to kernel numerics), whatever
its batch-mates are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm_serve.decoding.forward_spec import AttentionKind, ForwardSpec
from dllm_serve.models.kv_cache import KVBatch


@dataclass(slots=True)
class Batch:
    """One forward's inputs, plus where each row's requested logits land in the output."""

    input_ids: torch.Tensor  # [B, L]
    positions: torch.Tensor  # [B, L]
    attn_mask: torch.Tensor | None  # [B, 1, L, L] bool (True = may attend); None = all visible
    gather_rows: torch.Tensor  # [N] row of each requested logit
    gather_cols: torch.Tensor  # [N] position of each requested logit
    splits: list[int]  # how many of the N logits belong to each row, in row order
    kv: KVBatch | None = None  # per-row caches to read (and append to), None: no row has one

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


def build_batch(specs: list[ForwardSpec], pad_id: int) -> Batch:
    """Right-pad every row to the longest; mask padding and apply each row's attention kind."""
    device = specs[0].input_ids.device
    lengths = [int(s.input_ids.numel()) for s in specs]
    width = max(lengths)
    rows = len(specs)
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long, device=device)
    positions = torch.zeros((rows, width), dtype=torch.long, device=device)
    for r, spec in enumerate(specs):
        input_ids[r, : lengths[r]] = spec.input_ids
        positions[r, : lengths[r]] = spec.positions

    attn_mask = _attention_mask(specs, lengths, width, device)
    gather_rows = torch.cat([torch.full_like(s.logits_index, r) for r, s in enumerate(specs)]).to(
        device
    )
    gather_cols = torch.cat([s.logits_index for s in specs]).to(device)
    kv = None
    if any(s.kv_cache is not None for s in specs):
        kv = KVBatch([s.kv_cache for s in specs], write=[s.kv_write for s in specs])
    return Batch(
        input_ids=input_ids,
        positions=positions,
        attn_mask=attn_mask,
        gather_rows=gather_rows,
        gather_cols=gather_cols,
        splits=[int(s.logits_index.numel()) for s in specs],
        kv=kv,
    )


def _attention_mask(
    specs: list[ForwardSpec], lengths: list[int], width: int, device: torch.device
) -> torch.Tensor | None:
    causal_any = any(s.attention is AttentionKind.CAUSAL for s in specs)
    if not causal_any and all(n == width for n in lengths):
        return None  # every row full length and bidirectional: nothing to hide
    cols = torch.arange(width, device=device)
    key_valid = cols[None, :] < torch.tensor(lengths, device=device)[:, None]  # [B, L]
    mask = key_valid[:, None, None, :].expand(len(specs), 1, width, width).clone()
    if causal_any:
        is_causal = torch.tensor(
            [s.attention is AttentionKind.CAUSAL for s in specs], device=device
        )
        lower = cols[:, None] >= cols[None, :]  # query i may see key j <= i
        mask &= ~is_causal[:, None, None, None] | lower[None, None]
    return mask


def run_batch(model: torch.nn.Module, batch: Batch) -> list[torch.Tensor]:
    """One forward; the LM head runs only at the requested positions. Returns logits per row."""
    if batch.kv is None:
        hidden = model(batch.input_ids, batch.positions, batch.attn_mask)
    else:
        hidden = model(batch.input_ids, batch.positions, batch.attn_mask, kv_cache=batch.kv)
    selected = hidden[batch.gather_rows, batch.gather_cols]
    logits = model.lm_head(selected)
    return list(torch.split(logits, batch.splits))
