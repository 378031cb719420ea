"""Prefix reuse across requests (``--enable-prefix-caching``): a radix tree of whole chunks of
ended requests' K/V pages in the KV pool (models/kv_pool.py).

For the
families whose kept K/V at a position depend only on the tokens up to the end of its block
(causal, or block-causal with final blocks), a page's K/V are a function of the token ids
before and in it and of nothing else. So full pages outlive the request that computed them:
when a request ends, its kept pages go into a tree of *chunks* (``chunk`` tokens: one or more
whole pages, a whole number of the family's blocks), each keyed by its parent chunk and its
token ids; a new request walks the tree with its prompt, *pins* the chunks it matches (their
pages head its page table, read-only: it only ever writes past its kept length) and prefills
only the rest. A chunk is held by the cache until evicted: pinned chunks never; unpinned leaf
chunks, least recently used first, whenever a request needs a page and none is free. Admission
counts only the pages a request needs beyond its hit (plus the hit's pages nobody pinned yet:
pinning takes them out of what eviction may reclaim).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol


class PageTable(Protocol):
    """What the cache reads and moves in a request's page table (``kv_pool.KVPages``)."""

    id: int
    pages: list[int]
    shared: int  # its first pages: cached chunks it pins
    length: int  # its positions that hold K/V a forward may read


class PagePool(Protocol):
    """What the cache needs of the KV pool (``kv_pool.KVPool``): its page size, its count of
    pages promised to running requests (a published chunk's pages leave it), and the free list
    an evicted chunk's pages go back to."""

    page_size: int
    reserved_pages: int

    def give_back(self, page: int) -> None: ...


@dataclass(slots=True, eq=False)
class CachedChunk:
    """``chunk`` tokens' K/V in the prefix cache: its ``pages`` hold positions
    ``[depth * chunk, (depth + 1) * chunk)`` of every request whose tokens up to there equal
    ``tokens`` of this chunk and of its ancestors."""

    key: tuple[int, tuple[int, ...]]  # (the parent's serial, 0 at the root; these token ids)
    serial: int
    parent: CachedChunk | None
    pages: list[int]
    depth: int
    pins: int = 0  # running requests that hold it
    children: int = 0
    last_used: int = 0  # the cache's clock at its last match or insertion


class PrefixCache:
    """Chunks of ended requests' K/V, keyed by their token ids and their prefix (a radix
    tree of whole chunks: each key names its parent, so a match walks from the root), pinned
    by the running requests that hit them and evicted least recently used first (idle leaves
    only: a chunk's children would be unreachable without it). Engine thread only."""

    def __init__(self, pool: PagePool, chunk: int, *, copy_hits: bool = False) -> None:
        if chunk % pool.page_size:
            raise ValueError("a prefix-cache chunk is whole pages")
        self.pool = pool
        self.chunk = chunk
        self.copy_hits = copy_hits
        self.pages_per_chunk = chunk // pool.page_size
        self._chunks: dict[tuple[int, tuple[int, ...]], CachedChunk] = {}
        self._pins: dict[int, list[CachedChunk]] = {}  # a table's id -> the chunks it pins
        self._stalled: set[int] = set()  # tables whose next chunk another table cached first
        self._serials = itertools.count(1)
        self._clock = itertools.count(1)
        # Idle leaves by last use; entries go stale (re-checked when popped) rather than
        # being removed when a chunk is pinned, gets a child or is used again.
        self._idle: list[tuple[int, int, CachedChunk]] = []
        self.pinned_pages = 0
        self.cached_pages = 0
        self.evicted_pages = 0  # ever (tests and logs)

    @property
    def idle_pages(self) -> int:
        """Cached pages no running request pins (evictable, all of them eventually)."""
        return self.cached_pages - self.pinned_pages

    def __len__(self) -> int:
        return len(self._chunks)

    def match(self, tokens: Sequence[int], limit: int) -> list[CachedChunk]:
        """The longest chain of cached chunks that ``tokens`` start with, at most ``limit``
        tokens long (the positions the request's algorithm lets it take from a cache)."""
        hit: list[CachedChunk] = []
        parent, c = 0, self.chunk
        for start in range(0, min(limit, len(tokens)) - c + 1, c):
            found = self._chunks.get((parent, tuple(tokens[start : start + c])))
            if found is None:
                break
            hit.append(found)
            parent = found.serial
        return hit

    def unpinned_pages(self, chunks: Sequence[CachedChunk]) -> int:
        """Pages of ``chunks`` that pinning them would take from what eviction may reclaim."""
        return sum(len(c.pages) for c in chunks if not c.pins)

    def pin(self, kv: PageTable, chunks: Sequence[CachedChunk]) -> None:
        now = next(self._clock)
        for chunk in chunks:
            if not chunk.pins:
                self.pinned_pages += len(chunk.pages)
            chunk.pins += 1
            chunk.last_used = now
        self._pins[kv.id] = list(chunks)

    def unpin(self, kv: PageTable) -> None:
        """Unpin what ``kv`` pins, as when it ends, but cache nothing of it."""
        now = next(self._clock)
        for chunk in self._pins.pop(kv.id, []):
            chunk.pins -= 1
            chunk.last_used = now
            if not chunk.pins:
                self.pinned_pages -= len(chunk.pages)
                self._mark_idle(chunk)

    def publish(self, kv: PageTable, tokens: Callable[[], Sequence[int]]) -> None:
        """A running table's newly kept full chunks join the cache now (so a request that
        arrives while it decodes already hits its prompt): their pages change hands from the
        table to the cache, pinned by the table (its ``shared`` grows; the pool's reservation
        shrinks by as much as the pinned pages grow). ``tokens`` gives the token ids at its
        positions (called only when a chunk is complete). A chunk some other table cached
        first ends publishing for this one: its own copy stays its own until it ends."""
        c, per = self.chunk, self.pages_per_chunk
        depth = kv.shared // per
        if (depth + 1) * c > kv.length or kv.id in self._stalled:
            return
        ids = tokens()
        kept = min(kv.length, len(ids))
        hit = self._pins.setdefault(kv.id, [])
        assert len(hit) == depth and kv.shared == depth * per
        parent = hit[-1] if hit else None
        now = next(self._clock)
        while (depth + 1) * c <= kept:
            key = (parent.serial if parent else 0, tuple(ids[depth * c : (depth + 1) * c]))
            if key in self._chunks:
                self._stalled.add(kv.id)
                return
            pages = kv.pages[depth * per : (depth + 1) * per]
            chunk = CachedChunk(key, next(self._serials), parent, pages, depth, pins=1,
                                last_used=now)  # fmt: skip
            self._chunks[key] = chunk
            self.cached_pages += per
            self.pinned_pages += per
            self.pool.reserved_pages -= per
            if parent is not None:
                parent.children += 1
            hit.append(chunk)
            kv.shared += per
            parent = chunk
            depth += 1

    def release(self, kv: PageTable, tokens: Sequence[int] | None) -> list[int]:
        """``kv`` ends: unpin its hit and, given ``tokens``, cache the full chunks of its kept
        K/V past it (a chunk already cached by another request keeps the older copy). Returns
        the table's own pages the cache did not take (the caller frees them)."""
        hit = self._pins.pop(kv.id, [])
        self._stalled.discard(kv.id)
        now = next(self._clock)
        parent = hit[-1] if hit else None
        own = kv.pages[kv.shared :]
        if tokens is not None:
            c, per = self.chunk, self.pages_per_chunk
            kept = min(kv.length, len(tokens))
            depth = len(hit)
            while (depth + 1) * c <= kept:
                key = (parent.serial if parent else 0, tuple(tokens[depth * c : (depth + 1) * c]))
                first = (depth - len(hit)) * per
                found = self._chunks.get(key)
                if found is None:
                    pages, own[first : first + per] = own[first : first + per], [-1] * per
                    found = CachedChunk(
                        key, next(self._serials), parent, pages, depth, last_used=now
                    )
                    self._chunks[key] = found
                    self.cached_pages += per
                    if parent is not None:
                        parent.children += 1
                    self._mark_idle(found)
                else:  # cached already (another request computed it too): ours is freed
                    found.last_used = now
                    self._mark_idle(found)  # its older queue entry went stale
                parent = found
                depth += 1
        for chunk in hit:  # unpinned after the insertion: a parent with a new child stays
            chunk.pins -= 1
            chunk.last_used = now
            if not chunk.pins:
                self.pinned_pages -= len(chunk.pages)
                self._mark_idle(chunk)
        return [page for page in own if page >= 0]

    def _mark_idle(self, chunk: CachedChunk) -> None:
        if not chunk.pins and not chunk.children:
            heapq.heappush(self._idle, (chunk.last_used, chunk.serial, chunk))

    def evict(self) -> bool:
        """Give the least recently used idle leaf chunk's pages back to the pool; False when
        every cached chunk is pinned or has children (nothing to evict)."""
        while self._idle:
            used, _, chunk = heapq.heappop(self._idle)
            if (
                chunk.pins
                or chunk.children
                or chunk.last_used != used
                or self._chunks.get(chunk.key) is not chunk
            ):
                continue  # a stale entry: the chunk is busy again, or gone
            del self._chunks[chunk.key]
            self.cached_pages -= len(chunk.pages)
            self.evicted_pages += len(chunk.pages)
            for page in chunk.pages:
                self.pool.give_back(page)
            if chunk.parent is not None:
                chunk.parent.children -= 1
                self._mark_idle(chunk.parent)
            return True
        return False

    def clear(self) -> int:
        """Evict every idle chunk (pinned ones and their ancestors stay); returns the pages."""
        before = self.cached_pages
        while self.evict():
            pass
        return before - self.cached_pages
