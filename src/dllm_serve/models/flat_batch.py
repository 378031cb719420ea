"""One forward's inputs as a flat list of real tokens, with attention described per group.

Rows are concatenated without padding (``input_ids``/``positions`` are ``[T]`` for ``T`` real
tokens), so the linear layers — almost all of a forward's work — see no padded token. Attention
is the only part that needs the row structure; it runs per :class:`AttnGroup`, a run of
consecutive rows with the same query length and attention kind, as one SDPA call on views of
the flat tensors. No ``[L, L]`` mask is ever built:

- bidirectional, no cached prefix: the group's own keys, no mask;
- causal, no cached prefix: ``is_causal``;
- with a cached prefix of the same length ``P`` for every row (keys gathered from the KV pool):
  no mask (bidirectional: a block attends to its prefix and itself) or, causal, a lower-right
  ``[q_len, P + q_len]`` mask shared by the group's rows;
- rows whose prefixes differ: a ``[rows, 1, q_len, S]`` key-validity mask.

Masks are built once per forward (by the ModelRunner) and shared by every layer; ``q_len`` is
then a decode round or a block — a handful of tokens — never the whole canvas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class AttnGroup:
    """``rows`` consecutive rows of ``q_len`` tokens starting at flat token ``start``.

    ``kv_slots`` ``[rows, S]``: the KV-pool slots of each row's keys (its cached prefix, then
    its current tokens), or None when the keys are the current tokens themselves.
    ``mask`` is what SDPA gets as ``attn_mask`` (None, a causal bias or a bool tensor) and
    ``is_causal`` its flag.
    """

    start: int
    rows: int
    q_len: int
    kv_slots: torch.Tensor | None = None
    mask: Any = None
    is_causal: bool = False

    @property
    def end(self) -> int:
        return self.start + self.rows * self.q_len


@dataclass(slots=True)
class FlatBatch:
    """The model's view of one forward (built by the engine's ModelRunner).

    ``slot_mapping`` ``[T]``: the KV-pool slot each token's K/V is written to (None: the
    forward writes nothing, e.g. LLaDA without a cache). ``logits_index`` ``[N]``: the flat
    tokens whose hidden states leave the model (the LM head runs only there).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    groups: list[AttnGroup]
    logits_index: torch.Tensor
    slot_mapping: torch.Tensor | None = None
    max_position: int = 0  # the largest entry of ``positions`` (known on the host)
    # Flat tokens computed in the draft weight view (a tri-mode model's draft-only LoRA);
    # None: every token uses the base weights.
    draft_index: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def page_slots(table: torch.Tensor, cols: torch.Tensor, page_size: int) -> torch.Tensor:
    """Pool slots ``[rows, S]`` of positions ``cols`` (``arange(S)``) through page tables
    ``[rows, P]`` (``P * page_size >= S``). Device ops only (a captured graph computes it)."""
    return table.gather(1, (cols // page_size)[None, :].expand(table.shape[0], -1)) * page_size + (
        cols % page_size
    )


def prefix_keys(
    table: torch.Tensor,
    prefix: torch.Tensor,
    cols: torch.Tensor,
    query: torch.Tensor,
    causal: bool,
    zero_slot: int,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Key slots ``[rows, S]`` and mask ``[rows, 1, q, S]`` of rows whose prefixes differ.

    Row ``r``'s keys are its ``prefix[r]`` cached tokens, then its ``q`` current ones, at the
    slots its page table ``table[r]`` gives. Columns past them read the pool's zero slot,
    masked — never another request's slots, whatever they hold. Causal: key ``j`` is visible to
    query ``i`` iff ``j <= prefix + i``; else every key of the row is. ``cols`` is
    ``arange(S)``, ``query`` ``arange(q)``. Device ops only (a captured graph computes it, too).
    """
    q_len = query.shape[0]
    own = cols[None, :] < (prefix + q_len)[:, None]
    kv_slots = torch.where(own, page_slots(table, cols, page_size), zero_slot)
    if causal:
        limit = prefix[:, None] + query[None, :]
    else:
        limit = (prefix + q_len - 1)[:, None].expand(-1, q_len)
    mask = (cols[None, None, :] <= limit[:, :, None])[:, None]
    return kv_slots, mask
