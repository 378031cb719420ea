"""The KV pool: every request's keys and values in one preallocated buffer per layer.

The pool is sized once, at start-up, from a memory budget (``--kv-cache-memory``), so a step
never allocates K/V and a request is admitted only when its worst case fits: a request owns a
contiguous *span* of ``capacity`` token slots from admission to its end, and token ``p`` of
the request lives in slot ``span.start + p``. A forward writes the K/V of every token it
computes into its slot (one ``index_copy_`` per layer for the whole batch) and reads a row's
keys back with one gather; what the request *keeps* is only its ``length`` (its algorithm says
how long its exact prefix is), so dropping rejected drafts or a stale block is a change of
that integer: the freed slots are overwritten by the next write. Contiguous spans keep slot
arithmetic a single addition; the span allocator is first fit over a list of free intervals,
merged on free.

Keys are stored after RoPE (and after Qwen3's k-norm), so a cached token keeps the rotary
position it was computed at.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch


@dataclass(slots=True, eq=False)
class KVSpan:
    """A request's slots ``[start, start + capacity)``; ``length`` of them hold its prefix."""

    start: int
    capacity: int
    length: int = 0  # tokens whose K/V are final (the prefix a forward may read)


class KVPool:
    """K/V buffers ``[n_layers, slots, n_kv_heads, head_dim]`` and a span allocator."""

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        slots: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        scratch_slots: int = 0,
    ) -> None:
        if slots < 1:
            raise ValueError("the KV pool needs at least one slot")
        # One extra slot past the allocatable ones stays zero forever: masked key positions of
        # ragged rows point there, so a non-finite K/V elsewhere in the pool (another request's,
        # or a stale one) can never reach a row through its masked keys (0 · NaN = NaN).
        # ``scratch_slots`` after it belong to no request: the padding rows of a captured
        # graph (engine/graphs.py) write and read their K/V there.
        shape = (n_layers, slots + 1 + scratch_slots, n_kv_heads, head_dim)
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
                f"the KV pool ({slots} slots, {gib:.1f} GiB) does not fit in {device} memory; "
                "lower --kv-cache-memory (or --max-running-requests)"
            ) from exc
        self.slots = slots
        self.zero_slot = slots
        self.scratch_start = slots + 1
        self.scratch_slots = scratch_slots
        self._free: list[tuple[int, int]] = [(0, slots)]  # (start, size), sorted by start
        self.used = 0

    @staticmethod
    def bytes_per_slot(n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """K and V of one token in every layer."""
        return 2 * n_layers * n_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        """Bytes of the allocatable slots (K and V, every layer)."""
        return self.slots * (2 * self.k[:, 0].numel() * self.k.element_size())

    @property
    def free_slots(self) -> int:
        return self.slots - self.used

    @property
    def largest_free_span(self) -> int:
        return max((size for _, size in self._free), default=0)

    def allocate(self, capacity: int) -> KVSpan | None:
        """A span of ``capacity`` slots (first fit), or None when no free interval is that long."""
        if capacity < 1:
            raise ValueError("a KV span needs at least one slot")
        for i, (start, size) in enumerate(self._free):
            if size >= capacity:
                if size == capacity:
                    del self._free[i]
                else:
                    self._free[i] = (start + capacity, size - capacity)
                self.used += capacity
                return KVSpan(start, capacity)
        return None

    def free(self, span: KVSpan) -> None:
        """Return ``span``'s slots to the pool (merging with free neighbours)."""
        if span.capacity == 0:
            return
        start, size = span.start, span.capacity
        i = bisect.bisect_left(self._free, (start, 0))
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:  # merge left
            i -= 1
            start, size = self._free[i][0], self._free[i][1] + size
            del self._free[i]
        if i < len(self._free) and start + size == self._free[i][0]:  # merge right
            size += self._free[i][1]
            del self._free[i]
        self._free.insert(i, (start, size))
        self.used -= span.capacity
        span.capacity = span.length = 0  # a freed span can never be freed twice
