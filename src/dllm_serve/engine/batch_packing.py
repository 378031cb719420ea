"""Packing one step's rows into a :class:`FlatBatch`: real tokens only, attention per group.

The host side of the ModelRunner's forward. Rows (host :class:`RowSpec` lists) become one
int64 host buffer — token ids, positions, KV slots to write, logit positions, draft tokens —
copied to the device once; consecutive rows of one shape and attention kind share an
:class:`AttnGroup`, whose key slots and mask are built here once per forward and shared by
every layer. This runs once per step on the engine thread, between two forwards, so the host
cost per row is a few C-level list extends, never a Python loop per token.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import torch

from dllm_serve.decoding.forward_spec import AttentionKind, RowSpec
from dllm_serve.decoding.host_values import host_to_device, to_device
from dllm_serve.models.flat_batch import AttnGroup, FlatBatch
from dllm_serve.models.kv_pool import KVPool


@dataclass(slots=True)
class _Group:
    """Consecutive rows sharing one attention call, as the packer collects them."""

    start: int  # first flat token
    q_len: int
    causal: bool
    cached: bool  # the rows read a cached prefix from the KV pool
    rows: int = 1
    bases: list[int] = field(default_factory=list)  # each row's span start (cached groups)
    prefixes: list[int] = field(default_factory=list)  # each row's cached prefix length


def prefix_keys(
    base: torch.Tensor,
    prefix: torch.Tensor,
    cols: torch.Tensor,
    query: torch.Tensor,
    causal: bool,
    zero_slot: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Key slots ``[rows, S]`` and mask ``[rows, 1, q, S]`` of rows whose prefixes differ.

    Row ``r`` owns span slots from ``base[r]``; its keys are its ``prefix[r]`` cached tokens,
    then its ``q`` current ones. Columns past them read the pool's zero slot, masked — never
    another request's slots, whatever they hold. Causal: key ``j`` is visible to query ``i``
    iff ``j <= prefix + i``; else every key of the row is. ``cols`` is ``arange(S)``,
    ``query`` ``arange(q)``. Device ops only (a captured graph computes it, too).
    """
    q_len = query.shape[0]
    own = cols[None, :] < (prefix + q_len)[:, None]
    kv_slots = torch.where(own, base[:, None] + cols[None, :], zero_slot)
    if causal:
        limit = prefix[:, None] + query[None, :]
    else:
        limit = (prefix + q_len - 1)[:, None].expand(-1, q_len)
    mask = (cols[None, None, :] <= limit[:, :, None])[:, None]
    return kv_slots, mask


class BatchPacker:
    """Builds the :class:`FlatBatch` of a step's rows on ``device``."""

    def __init__(self, device: torch.device, pool: KVPool | None) -> None:
        self.device = device
        self.pool = pool
        self._arange = array("q", range(4096))  # positions 0.. as int64, sliced per row

    def build(self, rows: list[RowSpec]) -> tuple[FlatBatch, int]:
        """The flat batch of ``rows`` and ``M`` (logits per row after padding)."""
        # Lists grow in C (``list.extend``), positions are slices of a cached int64 range; one
        # conversion to int64 at the end (``array.extend`` from a list costs twice as much).
        ids: list[int] = []
        positions = array("q")
        slots: list[int] = []
        logits_at: list[int] = []
        draft: list[int] = []  # flat tokens in the draft weight view (draft-only LoRA)
        arange = self._arange
        width = max(len(r.logits_at) for r in rows)
        any_kv = any(r.kv is not None for r in rows)
        # Group consecutive rows of one shape; the rows arrive sorted by the scheduler.
        groups: list[_Group] = []
        block_rows: dict[int, RowSpec] = {}  # group index → its block-causal row
        last_key: tuple[int, AttentionKind, bool] | None = None
        offset = top = 0
        for row in rows:
            row.check()
            n = len(row.tokens)
            wanted = row.logits_at
            ids.extend(row.tokens)
            end = row.start + n
            if end > len(arange):
                arange = self._arange = array("q", range(2 * end))
            positions.extend(arange[row.start : end])
            top = max(top, end)
            kv = row.kv
            if any_kv:
                if kv is None:
                    raise ValueError("rows with and without a KV span cannot share a forward")
                if end > kv.capacity:
                    raise ValueError(f"a row of {end} tokens overflows its KV span")
                slots.extend(range(kv.start + row.start, kv.start + end))
            if row.draft:
                draft.extend(range(offset, offset + n))
            # ``map`` over a bound add runs in C: no Python frame per requested position.
            logits_at.extend(map(offset.__add__, wanted))
            if len(wanted) < width:
                logits_at.extend([offset + wanted[0]] * (width - len(wanted)))
            cached = kv is not None and row.start > 0
            # Rows of one shape and kind share an attention call; a block-causal row is a group
            # of its own (its mask depends on where its blocks fall).
            attention = row.attention
            key = None if attention is AttentionKind.BLOCK_CAUSAL else (n, attention, cached)
            if key is not None and key == last_key:
                groups[-1].rows += 1
            else:
                groups.append(_Group(offset, n, attention is AttentionKind.CAUSAL, cached))
                if key is None:
                    block_rows[len(groups) - 1] = row
            last_key = key
            if cached:
                assert kv is not None
                groups[-1].bases.append(kv.start)
                groups[-1].prefixes.append(row.start)
            offset += n
        t = len(ids)
        # One host buffer for every index of the step, one copy to the device.
        host = array("q", ids)
        host.extend(positions)
        host.extend(array("q", slots + logits_at + draft))
        packed = torch.frombuffer(host, dtype=torch.long)
        # Pinned and non-blocking on CUDA (decoding/host_values.py): the host goes on to
        # launch the forward while it copies.
        packed = host_to_device(packed, self.device)
        input_ids, pos = packed[:t], packed[t : 2 * t]
        slot_mapping = packed[2 * t : 3 * t] if any_kv else None
        index_start = (3 if any_kv else 2) * t
        index = packed[index_start : index_start + len(logits_at)]
        draft_index = packed[index_start + len(logits_at) :] if draft else None
        attn = [
            self._block_causal(g, block_rows[i]) if i in block_rows else self._group(g)
            for i, g in enumerate(groups)
        ]
        batch = FlatBatch(
            input_ids, pos, attn, index, slot_mapping, max_position=top - 1, draft_index=draft_index
        )
        return batch, width

    def _group(self, g: _Group) -> AttnGroup:
        if not g.cached:
            return AttnGroup(g.start, g.rows, g.q_len, is_causal=g.causal)
        # Keys: each row's prefix then its current tokens, gathered from the pool.
        longest = max(g.prefixes) + g.q_len
        packed = to_device(g.bases + g.prefixes, self.device, torch.long)
        base, prefix = packed[: g.rows], packed[g.rows :]
        cols = torch.arange(longest, device=self.device)
        query = torch.arange(g.q_len, device=self.device)
        if len(set(g.prefixes)) == 1:
            mask = None
            if g.causal:  # lower-right causal: query i sees keys j <= prefix + i ([q_len, S])
                mask = cols[None, :] <= (query + g.prefixes[0])[:, None]
            kv_slots = base[:, None] + cols[None, :]
            return AttnGroup(g.start, g.rows, g.q_len, kv_slots=kv_slots, mask=mask)
        assert self.pool is not None
        kv_slots, mask = prefix_keys(base, prefix, cols, query, g.causal, self.pool.zero_slot)
        return AttnGroup(g.start, g.rows, g.q_len, kv_slots=kv_slots, mask=mask)

    def _block_causal(self, g: _Group, row: RowSpec) -> AttnGroup:
        """One block-causal row: query at position p sees key q iff block(q) <= block(p).

        A ``[q_len, start + q_len]`` mask, built once per forward: this is the prefill of a
        block-diffusion prompt (its whole blocks), never a decode step.
        """
        keys = torch.arange(row.start + g.q_len, device=self.device)
        queries = keys[row.start :]
        mask = (keys[None, :] // row.block) <= (queries[:, None] // row.block)
        if not g.cached:
            return AttnGroup(g.start, g.rows, g.q_len, mask=mask)
        first = to_device(g.bases, self.device, torch.long)
        kv_slots = first[:, None] + keys[None, :]
        return AttnGroup(g.start, g.rows, g.q_len, kv_slots=kv_slots, mask=mask)
