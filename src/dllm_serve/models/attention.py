"""One forward's inputs and its attention: the flat batch of real tokens, the two ways its
attention runs (SDPA per group of rows, or one FlexAttention call for the whole batch), and how
host values reach the device.

**The flat batch.** Rows are concatenated without padding (``input_ids``/``positions`` are
``[T]`` for ``T`` real tokens), so the linear layers — almost all of a forward's work — see no
padded token. Attention is the only part that needs the row structure; it runs per
:class:`AttnGroup`, a run of consecutive rows with the same query length and attention kind, as
one SDPA call on views of the flat tensors. No ``[L, L]`` mask is ever built: - bidirectional,
no cached prefix: the group's own keys, no mask; - causal, no cached prefix: ``is_causal``; -
with a cached prefix of the same length ``P`` for every row (keys gathered from the KV pool):
no mask (bidirectional: a block attends to its prefix and itself) or, causal, a lower-right
``[q_len, P + q_len]`` mask shared by the group's rows; - rows whose prefixes differ: a
``[rows, 1, q_len, S]`` key-validity mask. Masks are built once per forward (by the
ModelRunner) and shared by every layer; ``q_len`` is then a decode round or a block — a handful
of tokens — never the whole canvas.

**FlexAttention** (``--attention-backend flex``): one call per layer for every row of a
forward, whatever each row's attention kind, with no ``[q, S]`` mask and no copy of cached K/V.
Every kind of attention a decoding mode uses — bidirectional over a canvas, causal, block-causal
(a block-diffusion prefill, or a finished block's K/V write fused with the next block's first
step), a block over its cached prefix, self-speculative draft and verify rows — is an interval
of key positions per query: query token ``t`` of a row sees that row's keys at positions
``[lo[t], hi[t])``. So one ``mask_mod`` serves them all, reading per-query tensors:

- **pool mode** (the keys are the KV pool, every layer's K/V already written there): a key's
  slot ``s`` lies in page ``s // page_size``; the page's owner and its index in the owner's page
  table give the key's request and position. ``mask = owner == row's owner and lo <= pos < hi``.
- **flat mode** (no KV pool: LLaDA and Dream without ``--kv-cache prefix``): the keys are the
  batch's own tokens, and a row's interval is in flat-token indices of its own segment.

The :class:`~torch.nn.attention.flex_attention.BlockMask` is built on the host from the page
tables (``BlockMask.from_kv_blocks``): for each block of 16 queries, the KV blocks (pages) its
rows may read — the kernel visits those only, and reads them where they are, so a request's
context is never gathered into a dense copy. Built once per forward, it serves every layer.
Queries are padded to a bucket (:func:`padded_length`): the compiled kernel is specialised
per length (``torch.compile(..., dynamic=False)``; the CPU template does not compile with
dynamic shapes), so a bucket bounds the compiles. Padding queries see nothing (their output
is 0 and nobody reads it).

FlexAttention compiles on CPU as well (inductor's C++ template): the CPU tests run the very
code path a GPU runs. On CPU it is slower than SDPA at the sizes of the test models, so SDPA
stays the CPU default (``--attention-backend``).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

# ---- the flat batch ----------------------------------------------------------------------------


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
class RowInput:
    """One row of a flat batch as a model that needs per-row inputs sees it (DiffusionGemma:
    its causal "encoder" rows and bidirectional "decoder" rows run with different layer scalars
    and inputs): ``length`` tokens from flat token ``offset``, rotary positions from ``start``,
    its attention kind and the row's opaque ``model_input`` (``RowSpec.model_input``)."""

    offset: int
    length: int
    start: int
    causal: bool
    model_input: Any = None


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
    # ``[T]`` bool: the tokens computed in the draft weight view (a tri-mode model's draft-only
    # LoRA); None: every token uses the base weights.
    draft: torch.Tensor | None = None
    # FlexAttention's plan for the whole forward; None: the SDPA groups above.
    flex: FlexPlan | None = None
    # The logits' layout: row r asked for ``logit_counts[r]`` positions, at
    # ``logits_index[logit_offsets[r] :][: count]``; ``logit_layout`` ``[R, M]`` maps row r's
    # j-th position to its index in the LM head's output (None: the head's output is already
    # ``[R, M]``, every row padded to M by repeating its first position).
    logit_counts: list[int] = field(default_factory=list)
    logit_offsets: list[int] = field(default_factory=list)
    logit_layout: torch.Tensor | None = None
    # Each row's place and kind, for a model that asks for them (``needs_row_inputs``); None
    # for the others (no per-row host cost).
    row_inputs: list[RowInput] | None = None
    # ``[R]``: the flat index of each row's first token (a block-routed MoE's routing blocks
    # start there; models/routing.py). None where the packer was not asked for them.
    row_offsets: torch.Tensor | None = None

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


def staged(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values, device="cuda")`` and ``.to("cuda")`` copy blocking: PyTorch then
    synchronises the stream, so the host waits until every kernel already queued has run — in a
    step's sampler, the whole forward — and the sampler's remaining launches stop overlapping the
    device's work. A non-blocking copy from ordinary (pageable) host memory is not enough either:
    the driver may stage it through a stream synchronisation of its own. So on CUDA the values are
    first put in pinned memory (PyTorch's caching host allocator: reused, and kept alive until the
    copy that reads it has run) and copied non-blocking; stream order puts the copy before any
    kernel that reads it. Elsewhere (CPU, and the meta device of the device-safety tests) the copy
    is the same call without the pinning.

    The CPU tensor ``host``, in pinned memory when it is bound for CUDA: the source of a
    ``non_blocking=True`` copy (``.to`` or ``copy_``) that never waits."""
    return host.pin_memory() if device.type == "cuda" else host


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The CPU tensor ``host`` on ``device`` without a host wait (itself when on the CPU)."""
    return staged(host, device).to(device, non_blocking=True)


def to_device(
    values: Sequence[int] | Sequence[float] | Sequence[bool],
    device: torch.device,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on ``device`` (see :func:`host_to_device`)."""
    return host_to_device(torch.tensor(values, dtype=dtype), device)


# ---- FlexAttention -----------------------------------------------------------------------------


Q_BLOCK = 16  # queries per BlockMask row (the kernel's query tile is set to it on CUDA)
KV_BLOCK = 16  # keys per BlockMask column: a page of the KV pool
# Padded query lengths: one compiled kernel each (the largest forwards run unpadded).
BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def padded_length(tokens: int) -> int:
    """The bucket ``tokens`` queries are padded to (a multiple of the query block past it)."""
    for size in BUCKETS:
        if tokens <= size:
            return size
    return -(-tokens // 1024) * 1024


def mask_width(padded: int, kv_blocks: int, row_pages: int, device: torch.device) -> int:
    """Columns of the block mask's ``kv_indices`` for ``padded`` queries: fixed per padded
    length, so the compiled kernel (which specialises on the shape) is compiled once per
    length, never per step. A block of ``Q_BLOCK`` queries holds at most ``Q_BLOCK`` rows, each
    reading at most ``row_pages`` pages. The CPU kernel wants one column per KV block of the
    whole key length."""
    if device.type == "cpu":
        return kv_blocks
    return max(1, min(kv_blocks, min(Q_BLOCK, padded) * row_pages))


# Graphs dynamo may keep per compiled function: one per (mask kind, padded length, key length,
# heads, head size), about 20 for a served model, more in a test process that loads many.
# Past the limit dynamo would run flex_attention eagerly, which evaluates the mask over every
# query and key of the pool (ignoring the block lists); that is made an error instead.
RECOMPILE_LIMIT = 1024
# Dynamo's settings are per thread: graphs are captured on the thread that builds the engine
# and forwards run on the engine thread, so each thread that calls flex sets them for itself.
_thread = threading.local()


def _compiled() -> Any:
    if not getattr(_thread, "configured", False):
        import torch._dynamo

        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
        limit = max(config.accumulated_recompile_limit, RECOMPILE_LIMIT)
        config.accumulated_recompile_limit = limit
        config.fail_on_recompile_limit_hit = True
        _thread.configured = True
    return _compiled_flex()


@functools.cache
def _compiled_flex() -> Any:
    # One compiled callable per process: dynamo keys its graphs on the mask_mod's code (one of
    # the two below) and the shapes (the padded length, the model's heads and head size).
    return torch.compile(flex_attention, dynamic=False)


def _pool_mask(
    page_owner: torch.Tensor,
    page_index: torch.Tensor,
    q_owner: torch.Tensor,
    q_lo: torch.Tensor,
    q_hi: torch.Tensor,
    page_size: int,
) -> Any:
    def mask_mod(b: Any, h: Any, q: Any, kv: Any) -> Any:
        page = kv // page_size
        position = page_index[page] * page_size + kv % page_size
        return (page_owner[page] == q_owner[q]) & (position >= q_lo[q]) & (position < q_hi[q])

    return mask_mod


def _flat_mask(q_lo: torch.Tensor, q_hi: torch.Tensor) -> Any:
    def mask_mod(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return (kv >= q_lo[q]) & (kv < q_hi[q])

    return mask_mod


@dataclass(slots=True)
class FlexPlan:
    """One forward's attention for FlexAttention: the padded query length, and the block mask
    every layer reads its keys through."""

    padded: int  # queries after padding (a bucket)
    block_mask: BlockMask
    pool: bool  # keys from the KV pool (else: the batch's own tokens)


class PlanBuffers:
    """Persistent device tensors of the plans of one padded length over the KV pool, and the
    plan built once over them: a captured graph reads these very tensors at every replay, and
    :func:`build_plan` rewrites their contents for each step (``meta``: every query's owner,
    ``lo``, ``hi``, then each query block's count of KV blocks; ``kv_indices``: the blocks)."""

    def __init__(
        self,
        padded: int,
        kv_length: int,
        width: int,
        page_owner: torch.Tensor,
        page_index: torch.Tensor,
        page_size: int,
        device: torch.device,
    ) -> None:
        n_qb = padded // Q_BLOCK
        self.padded, self.kv_length, self.width = padded, kv_length, width
        self.meta = torch.zeros(3 * padded + n_qb, dtype=torch.int32, device=device)
        self.kv_indices = torch.zeros(n_qb * width, dtype=torch.int32, device=device)
        owner, lo, hi, counts = self.meta.split([padded, padded, padded, n_qb])
        owner.fill_(-2)  # padding: an owner no page has (until a step writes real rows)
        mask_mod = _pool_mask(page_owner, page_index, owner, lo, hi, page_size)
        block_mask = BlockMask.from_kv_blocks(
            counts.view(1, 1, n_qb),
            self.kv_indices.view(1, 1, n_qb, width),
            BLOCK_SIZE=(Q_BLOCK, KV_BLOCK),
            mask_mod=mask_mod,
            seq_lengths=(padded, kv_length),
            compute_q_blocks=False,
        )
        self.plan = FlexPlan(padded, block_mask, True)


@dataclass(slots=True)
class RowAttention:
    """One row of a forward, as the plan builder sees it: its flat offset and length, the
    interval of keys each of its queries sees (``lo``, ``hi``: positions, or flat indices in
    flat mode) and the pages it may read (pool mode)."""

    offset: int
    length: int
    lo: list[int]
    hi: list[int]
    owner: int = -1
    pages: list[int] | None = None


def build_plan(
    rows: list[RowAttention],
    *,
    kv_length: int,
    device: torch.device,
    page_owner: torch.Tensor | None = None,
    page_index: torch.Tensor | None = None,
    page_size: int = KV_BLOCK,
    row_pages: int = 0,
    released: Sequence[int] = (),
    buffers: PlanBuffers | None = None,
) -> FlexPlan:
    """The :class:`FlexPlan` of ``rows`` over keys of length ``kv_length`` (the pool's slots; in
    flat mode the padded batch, whatever is passed). Pool mode needs ``page_owner`` /
    ``page_index``: device tensors of every page's owner and index in its owner's table, which
    this call brings up to date for the rows' pages and for the ``released`` pages (given back
    since the last plan), and ``row_pages``, the most pages one row may read. With ``buffers``
    (a captured graph's) the plan is written into them and their plan returned; else new
    tensors hold it. One host→device copy for the per-query tensors, the block lists and the
    page tables."""
    tokens = rows[-1].offset + rows[-1].length if rows else 0
    padded = buffers.padded if buffers is not None else padded_length(tokens)
    if tokens > padded:
        raise ValueError(f"{tokens} queries do not fit a plan of {padded}")
    pool = page_owner is not None
    if not pool:  # the keys are the batch's own tokens, padded like the queries
        kv_length = padded
    n_qb = padded // Q_BLOCK
    n_kb = -(-kv_length // KV_BLOCK)
    if buffers is not None:
        width = buffers.width
    else:
        width = mask_width(padded, n_kb, row_pages if pool else n_kb, device)
    owner = [-2] * padded  # padding queries: an owner no page has, and an empty interval
    lo = [0] * padded
    hi = [0] * padded
    visits: list[set[int]] = [set() for _ in range(n_qb)]
    for row in rows:
        end = row.offset + row.length
        owner[row.offset : end] = [row.owner] * row.length
        lo[row.offset : end] = row.lo
        hi[row.offset : end] = row.hi
        first, last = min(row.lo), max(row.hi)
        if pool:
            assert row.pages is not None
            blocks = row.pages[first // page_size : -(-last // page_size)]
        else:
            blocks = list(range(first // KV_BLOCK, -(-last // KV_BLOCK)))
        for qb in range(row.offset // Q_BLOCK, -(-end // Q_BLOCK)):
            visits[qb].update(blocks)
    counts = [len(v) for v in visits]
    if max(counts, default=0) > width:
        raise ValueError(f"a query block reads {max(counts)} KV blocks, more than {width}")
    # Only each query block's first ``counts[qb]`` entries are read: they are scattered into
    # the ``[n_qb, width]`` table on the device (the rest may hold anything).
    values: list[int] = []
    where: list[int] = []
    for qb, blocks in enumerate(visits):
        values.extend(sorted(blocks))
        where.extend(range(qb * width, qb * width + len(blocks)))
    # Pool mode: every page of these rows with its owner and its index in the owner's table,
    # written into the pool's tables below (in the same host→device copy), after the pages
    # given back since the last forward are marked unowned: the mask is then exact on its own,
    # whatever pages the kernel visits.
    held = {page for row in rows for page in row.pages or ()}
    pages = [page for page in released if page not in held]  # one write per page
    owners = [0] * len(pages)
    order = [0] * len(pages)
    if pool:
        for row in rows:
            assert row.pages is not None
            pages.extend(row.pages)
            owners.extend([row.owner] * len(row.pages))
            order.extend(range(len(row.pages)))
    meta = 3 * padded + n_qb
    host = torch.tensor(
        owner + lo + hi + counts + values + where + pages + owners + order, dtype=torch.int32
    )
    packed = host_to_device(host, device)
    parts = packed.split([meta, len(values), len(values), *(len(pages),) * 3])
    if buffers is not None:
        buffers.meta.copy_(parts[0])
        kv_indices = buffers.kv_indices
    else:
        kv_indices = torch.zeros(n_qb * width, dtype=torch.int32, device=device)
    kv_indices.index_copy_(0, parts[2].long(), parts[1])
    if pool:
        assert page_owner is not None and page_index is not None
        ids = parts[3].long()
        page_owner.index_copy_(0, ids, parts[4])
        page_index.index_copy_(0, ids, parts[5])
    if buffers is not None:
        return buffers.plan
    q_owner, q_lo, q_hi, kv_num_blocks = parts[0].split([padded, padded, padded, n_qb])
    if pool:
        mask_mod = _pool_mask(page_owner, page_index, q_owner, q_lo, q_hi, page_size)
    else:
        mask_mod = _flat_mask(q_lo, q_hi)
    block_mask = BlockMask.from_kv_blocks(
        kv_num_blocks.view(1, 1, n_qb),
        kv_indices.view(1, 1, n_qb, width),
        BLOCK_SIZE=(Q_BLOCK, KV_BLOCK),
        mask_mod=mask_mod,
        seq_lengths=(padded, kv_length),
        compute_q_blocks=False,
    )
    return FlexPlan(padded, block_mask, pool)


# On CUDA the kernel's tiles must divide the block mask's blocks (16 × 16, a KV page); one
# kernel family (not the split-KV decoding kernel) for every query length.
_CUDA_KERNEL_OPTIONS = {"BLOCK_M": Q_BLOCK, "BLOCK_N": KV_BLOCK, "FORCE_USE_FLEX_ATTENTION": True}


def flex_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: FlexPlan) -> torch.Tensor:
    """Attention of flat queries ``q`` ``[T, H, D]`` over keys ``k``/``v`` ``[S, Hkv, D]`` (the
    pool's slots of one layer, or the batch's own keys) per ``plan``: ``[T, H, D]``."""
    t, heads, dim = q.shape
    if plan.padded > t:
        q = torch.cat([q, q.new_zeros(plan.padded - t, heads, dim)])
    if not plan.pool and k.shape[0] < plan.padded:  # flat mode: keys padded like the queries
        pad = plan.padded - k.shape[0]
        k = torch.cat([k, k.new_zeros(pad, *k.shape[1:])])
        v = torch.cat([v, v.new_zeros(pad, *v.shape[1:])])
    out = _compiled()(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        block_mask=plan.block_mask,
        enable_gqa=heads != k.shape[1],
        kernel_options=_CUDA_KERNEL_OPTIONS if q.device.type == "cuda" else None,
    )
    return out[0].transpose(0, 1)[:t]


def sdpa_by_group(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    groups: Sequence[AttnGroup],
    pool_kv: tuple[torch.Tensor, torch.Tensor] | None,
    head_dim: int,
    *,
    masks: Sequence[tuple[torch.Tensor | None, bool]] | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """The SDPA path: one call per group of equal-length rows, ``[T, H · head_dim]``.

    A group without ``kv_slots`` attends to its own tokens' ``k``/``v``; one with them reads
    its rows' keys from the pool views ``pool_kv`` (this layer's K and V). ``masks`` replaces
    each group's own (mask, causal) pair (a model with several attention kinds per layer
    type builds its own); ``scale`` the default ``1/√head_dim``. Grouped-query attention runs
    without repeating K/V (``enable_gqa``).
    """
    outs = []
    for i, g in enumerate(groups):
        shape = (g.rows, g.q_len, -1, head_dim)
        qg = q[g.start : g.end].view(shape).transpose(1, 2)
        if g.kv_slots is None:
            kg = k[g.start : g.end].view(shape).transpose(1, 2)
            vg = v[g.start : g.end].view(shape).transpose(1, 2)
        else:
            assert pool_kv is not None
            kg, vg = pool_kv[0][g.kv_slots].transpose(1, 2), pool_kv[1][g.kv_slots].transpose(1, 2)
        mask, is_causal = masks[i] if masks is not None else (g.mask, g.is_causal)
        out = torch.nn.functional.scaled_dot_product_attention(
            qg, kg, vg, attn_mask=mask, is_causal=is_causal, scale=scale,
            enable_gqa=qg.shape[1] != kg.shape[1],
        )  # fmt: skip
        outs.append(out.transpose(1, 2).reshape(g.end - g.start, -1))
    return outs[0] if len(outs) == 1 else torch.cat(outs)
