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
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

PAGE_SIZE = 16  # tokens per page: a divisor of every block size the families use


@dataclass(slots=True, eq=False)
class KVPages:
    """A request's page table in the pool.

    ``id`` tells its pages apart from every other request's (attention masks compare it);
    ``reserved`` is how many pages it may hold at most (its worst case, counted at admission);
    ``pages[i]`` holds positions ``[i * page_size, (i + 1) * page_size)``; ``length`` of its
    positions hold K/V a forward may read as a prefix.
    """

    id: int
    reserved: int
    page_size: int = PAGE_SIZE
    pages: list[int] = field(default_factory=list)
    length: int = 0

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
        # Free pages as a stack: the most recently freed page is reused first (warm memory).
        self._free = list(range(self.num_pages - 1, -1, -1))
        self.reserved_pages = 0  # pages promised to running requests (their worst cases)
        self._ids = itertools.count(1)

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
        """Pages requests hold now (their contexts; reservations not yet taken excluded)."""
        return self.num_pages - len(self._free)

    @property
    def free_pages(self) -> int:
        """Pages no running request has reserved: what admission may promise."""
        return self.num_pages - self.reserved_pages

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def reserve(self, tokens: int) -> KVPages | None:
        """A page table that may grow to ``tokens`` positions, or None when the unreserved
        pages cannot hold it (the request waits)."""
        if tokens < 1:
            raise ValueError("a KV reservation needs at least one token")
        need = self.pages_for(tokens)
        if need > self.free_pages:
            return None
        self.reserved_pages += need
        return KVPages(next(self._ids), need, self.page_size)

    def grow(self, kv: KVPages, tokens: int) -> None:
        """Take pages until ``kv`` holds positions ``[0, tokens)`` (within its reservation,
        so a free page is always there)."""
        need = self.pages_for(tokens)
        if need > kv.reserved:
            raise ValueError(
                f"a row of {tokens} tokens overflows its KV reservation ({kv.capacity} tokens)"
            )
        while len(kv.pages) < need:
            kv.pages.append(self._free.pop())

    def trim(self, kv: KVPages) -> None:
        """Give back the pages past ``kv.length``: nothing there is read before it is written."""
        keep = self.pages_for(kv.length)
        while len(kv.pages) > keep:
            page = kv.pages.pop()
            self._free.append(page)
            self.released.append(page)

    def free(self, kv: KVPages) -> None:
        """Give back every page and the reservation (a freed table can never be freed twice)."""
        self._free.extend(reversed(kv.pages))
        self.released.extend(kv.pages)
        kv.pages.clear()
        self.reserved_pages -= kv.reserved
        kv.reserved = kv.length = 0
