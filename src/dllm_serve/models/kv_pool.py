"""The KV pool: every request's keys and values in one preallocated buffer per layer, in pages.

The pool is sized once, at start-up, from a memory budget (``--kv-cache-memory``), so a step
never allocates device memory. Its slots are cut into fixed-size *pages* (:data:`PAGE_SIZE`
tokens). A request holds a :class:`KVPages`: its page table, where its position ``p`` lives in
slot ``pages[p // page_size] * page_size + p % page_size``. Pages need not be contiguous, so
any free pages serve any request (no fragmentation), and a request's pages are taken as its
context grows (a block committed, drafts accepted) and given back as it shrinks (rejected
drafts, a stale block), when it finishes or is aborted.

Admission is by reservation: a request reserves the pages of its worst case when it starts
(its algorithm's ``kv_tokens``) and takes them physically only as it needs them, so a running
request can always finish, whatever the others do, and no request is ever preempted. What a
request *keeps* is its ``length`` (its algorithm says how long its exact prefix is); the pages
past it are given back after each step (:meth:`KVPool.trim`) and the next forward takes them
again for the positions it writes.

A forward writes the K/V of every token it computes into its slot (one ``index_copy_`` per
layer for the whole batch). Keys are stored after RoPE (and after Qwen3's k-norm), so a cached
token keeps the rotary position it was computed at.

**Prefix reuse across requests** (``--enable-prefix-caching``) keeps ended requests' full
pages in a radix tree of chunks: models/prefix_cache.py.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dllm_serve.models.prefix_cache import CachedChunk, PrefixCache

PAGE_SIZE = 16  # tokens per page: a divisor of every block size the families use


@dataclass(slots=True, eq=False)
class KVPages:
    """A request's page table in the pool.

    ``id`` tells its pages apart from every other request's (attention masks compare it);
    ``reserved`` is how many pages it may hold at most (its worst case, counted at admission);
    ``pages[i]`` holds positions ``[i * page_size, (i + 1) * page_size)``; ``length`` of its
    positions hold K/V a forward may read as a prefix. ``shared``: its first pages belong to
    the prefix cache (a hit, pinned): read-only, never trimmed nor freed by this table.
    """

    id: int
    reserved: int
    page_size: int = PAGE_SIZE
    pages: list[int] = field(default_factory=list)
    length: int = 0
    shared: int = 0

    @property
    def capacity(self) -> int:
        """Tokens the reservation holds."""
        return self.reserved * self.page_size

    def slot(self, position: int) -> int:
        """The pool slot of ``position`` (its page must be held)."""
        ps = self.page_size
        return self.pages[position // ps] * ps + position % ps

    def slots(self, start: int, end: int) -> list[int]:
        """The slots of positions ``[start, end)``, built a page at a time (C-level ranges)."""
        ps, pages, out = self.page_size, self.pages, []
        page = start // ps
        while start < end:
            stop = min(end, (page + 1) * ps)
            base = pages[page] * ps - page * ps
            out.extend(range(base + start, base + stop))
            start, page = stop, page + 1
        return out


class KVPool:
    """K/V buffers ``[n_layers, slots + extra, n_kv_heads, head_dim]`` and a page allocator.

    ``slots`` is rounded down to whole pages. After the pages comes one slot that stays zero
    forever (masked key columns of ragged rows read it, so a non-finite K/V elsewhere in the
    pool can never reach a row through a masked key: 0 · NaN = NaN), then ``scratch_slots``
    that belong to no request (the padding rows of a captured graph write and read there).
    """

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        slots: int,
        *,
        page_size: int = PAGE_SIZE,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        scratch_slots: int = 0,
    ) -> None:
        if page_size < 1:
            raise ValueError("a KV page needs at least one slot")
        if slots < page_size:
            raise ValueError(f"the KV pool needs at least one page ({page_size} slots)")
        self.page_size = page_size
        self.num_pages = slots // page_size
        self.slots = self.num_pages * page_size
        # Scratch starts on a page boundary, so scratch is whole pages too.
        scratch = -(-scratch_slots // page_size) * page_size
        shape = (n_layers, self.slots + page_size + scratch, n_kv_heads, head_dim)
        try:
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        except RuntimeError as exc:  # torch.OutOfMemoryError on CUDA, the allocator's on CPU
            cpu_oom = "DefaultCPUAllocator: can't allocate memory" in str(exc)
            if not (isinstance(exc, torch.OutOfMemoryError) or cpu_oom):
                raise  # a device fault is not a sizing problem
            per_slot = self.bytes_per_slot(n_layers, n_kv_heads, head_dim, dtype)
            gib = per_slot * shape[1] / 2**30
            # One line at start-up, not a torch traceback, naming the size's flag.
            raise ValueError(
                f"the KV pool ({self.slots} slots, {gib:.1f} GiB) does not fit in {device} "
                "memory; lower --kv-cache-memory (or --max-running-requests)"
            ) from exc
        self.zero_slot = self.slots
        # The page after the last allocatable one: its first slot is the zero slot, and no
        # request holds it (a page-table entry past a row's pages may point at it safely).
        self.zero_page = self.num_pages
        self.scratch_start = self.slots + page_size
        self.scratch_slots = scratch
        # Every page's owner (a table's id; 0: none) and its index in the owner's table, as the
        # FlexAttention mask reads them (models/attention.py); kept current by the runner for
        # the pages of each forward's rows.
        total_pages = shape[1] // page_size
        self.page_owner = torch.zeros(total_pages, dtype=torch.int32, device=device)
        self.page_index = torch.zeros(total_pages, dtype=torch.int32, device=device)
        # Pages given back since the tables above were last brought up to date.
        self.released: list[int] = []
        # Prefix-cache hits to copy (table id, source slots, destination slots) before the
        # next forward (:meth:`take_copies`; every rank of a tensor-parallel group applies them).
        self.copies: list[tuple[int, list[int], list[int]]] = []
        # Free pages as a stack: the most recently freed page is reused first (warm memory).
        self._free = list(range(self.num_pages - 1, -1, -1))
        # Pages promised to running requests: their worst cases less their prefix hits.
        self.reserved_pages = 0
        self._ids = itertools.count(1)
        self.cache: PrefixCache | None = None  # prefix reuse across requests (off: None)

    def enable_prefix_cache(self, chunk: int, *, copy_hits: bool = False) -> PrefixCache:
        """Keep the full pages of ended requests for reuse, in chunks of ``chunk`` tokens
        (rounded up to whole pages and whole ``chunk``s: the family's block). ``copy_hits``:
        a hit's K/V are copied into pages of the request's own instead of shared (for an
        attention whose mask gives every page a single owner)."""
        if self.reserved_pages or self.pages_used:
            raise RuntimeError("the prefix cache is enabled on an idle pool only")
        chunk = math.lcm(self.page_size, max(1, chunk))
        self.cache = PrefixCache(self, chunk, copy_hits=copy_hits)
        return self.cache

    @staticmethod
    def bytes_per_slot(n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """K and V of one token in every layer."""
        return 2 * n_layers * n_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        """Bytes of the allocatable slots (K and V, every layer)."""
        return self.slots * (2 * self.k[:, 0].numel() * self.k.element_size())

    @property
    def pages_used(self) -> int:
        """Pages requests hold now (their contexts, prefix hits they pin included; reservations
        not yet taken and idle cached pages excluded)."""
        idle = self.cache.idle_pages if self.cache is not None else 0
        return self.num_pages - len(self._free) - idle

    @property
    def free_pages(self) -> int:
        """Pages no running request has reserved or pinned: what admission may promise (idle
        cached pages count: eviction reclaims them when they are needed)."""
        pinned = self.cache.pinned_pages if self.cache is not None else 0
        return self.num_pages - self.reserved_pages - pinned

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def reserve(self, tokens: int, hit: Sequence[CachedChunk] = ()) -> KVPages | None:
        """A page table that may grow to ``tokens`` positions, or None when the unreserved
        pages cannot hold it (the request waits). ``hit``: prefix-cache chunks it starts with
        (:meth:`PrefixCache.match`): pinned, at the head of its table, its ``length`` already;
        only the pages past them are reserved."""
        if tokens < 1:
            raise ValueError("a KV reservation needs at least one token")
        total = self.pages_for(tokens)
        shared = [page for chunk in hit for page in chunk.pages]
        if len(shared) >= total and hit:
            raise ValueError("a prefix hit must leave the request positions of its own")
        need = total - len(shared)
        pins = self.cache.unpinned_pages(hit) if self.cache is not None and hit else 0
        if need + pins > self.free_pages:
            return None
        if hit and self.cache is not None and self.cache.copy_hits:
            return self._reserve_copying(total, hit, shared)
        kv = KVPages(next(self._ids), total, self.page_size, pages=shared, shared=len(shared))
        kv.length = len(shared) * self.page_size
        if hit:
            assert self.cache is not None
            self.cache.pin(kv, hit)
        self.reserved_pages += need
        return kv

    def _reserve_copying(
        self, total: int, hit: Sequence[CachedChunk], shared: list[int]
    ) -> KVPages | None:
        """A reservation of ``total`` pages of its own whose first will hold a copy of the
        hit's K/V: the copy is queued (:attr:`copies`) and made before the next forward, the
        first that may read or write either side (a source page evicted meanwhile still holds
        its K/V until a forward writes it). The hit is pinned only while the table's pages are
        taken (that may evict), so it costs no page afterwards."""
        assert self.cache is not None
        if total + self.cache.unpinned_pages(hit) > self.free_pages:
            return None
        kv = KVPages(next(self._ids), total, self.page_size)
        self.reserved_pages += total
        self.cache.pin(kv, hit)
        length = len(shared) * self.page_size
        self.grow(kv, length)
        ps = self.page_size
        self.copies.append((kv.id, [page * ps + i for page in shared for i in range(ps)],
                            kv.slots(0, length)))  # fmt: skip
        self.cache.unpin(kv)
        kv.length = length
        return kv

    def take_copies(self) -> list[tuple[list[int], list[int]]]:
        """The queued hit copies, handed over (rank 0 sends them to the workers too)."""
        copies, self.copies = self.copies, []
        return [(src, dst) for _, src, dst in copies]

    def apply_copies(self, copies: Sequence[tuple[list[int], list[int]]]) -> None:
        """Copy K and V, every layer at once, from each pair's source slots to its
        destination slots (one gather and one scatter per buffer for all of them)."""
        if not copies:
            return
        device = self.k.device
        src = torch.tensor([s for pair in copies for s in pair[0]], device=device)
        dst = torch.tensor([d for pair in copies for d in pair[1]], device=device)
        for buffer in (self.k, self.v):
            buffer.index_copy_(1, dst, buffer.index_select(1, src))

    def grow(self, kv: KVPages, tokens: int) -> None:
        """Take pages until ``kv`` holds positions ``[0, tokens)`` (within its reservation,
        so a free page is always there)."""
        need = self.pages_for(tokens)
        if need > kv.reserved:
            raise ValueError(
                f"a row of {tokens} tokens overflows its KV reservation ({kv.capacity} tokens)"
            )
        while len(kv.pages) < need:
            kv.pages.append(self._take())

    def _take(self) -> int:
        """A free page; with none free, the least recently used idle cached chunk's (the
        reservations guarantee one: reserved + pinned pages never exceed the pool)."""
        if not self._free and (self.cache is None or not self.cache.evict()):
            raise RuntimeError("no free KV page although the reservation holds one")
        return self._free.pop()

    def trim(self, kv: KVPages) -> None:
        """Give back the pages past ``kv.length``: nothing there is read before it is written
        (never a shared page: a request only writes past its prefix hit)."""
        keep = max(self.pages_for(kv.length), kv.shared)
        while len(kv.pages) > keep:
            self.give_back(kv.pages.pop())

    def free(self, kv: KVPages, tokens: Sequence[int] | None = None) -> None:
        """Give back every page and the reservation (a freed table can never be freed twice).

        With the prefix cache and ``tokens`` (the token ids at the table's positions, at least
        its first ``length``), the full chunks of its kept K/V go into the cache instead;
        its pinned hit is unpinned either way."""
        if any(c[0] == kv.id for c in self.copies):
            # Freed before its hit was copied (no forward ran since its admission): its pages
            # must not be the copy's target once they are another table's, and they hold no
            # K/V to cache.
            self.copies = [c for c in self.copies if c[0] != kv.id]
            tokens = None
        own = kv.pages[kv.shared :]
        if self.cache is not None:
            own = self.cache.release(kv, tokens)
        for page in reversed(own):
            self.give_back(page)
        kv.pages.clear()
        self.reserved_pages -= kv.reserved - kv.shared
        kv.reserved = kv.length = kv.shared = 0

    def give_back(self, page: int) -> None:
        """A page back on the free list (and in ``released``: its FlexAttention owner is stale)."""
        self._free.append(page)
        self.released.append(page)
