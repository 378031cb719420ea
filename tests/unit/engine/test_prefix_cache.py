"""The prefix cache of the paged KV pool on its own: keys (token ids and the whole prefix before
them), pins and what admission may promise, insertion of an ended table's full chunks,
least-recently-used eviction of idle leaves only, and tables that never trim or free a shared
page."""

from __future__ import annotations

import pytest
import torch

from dllm_serve.models.kv_pool import PAGE_SIZE, KVPool

PS = PAGE_SIZE


def pool(pages: int, chunk: int = PS) -> KVPool:
    kv = KVPool(1, 1, 2, pages * PS)
    kv.enable_prefix_cache(chunk)
    return kv


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def finished(kv_pool: KVPool, tokens: list[int], kept: int, hit=()):  # type: ignore[no-untyped-def]
    """A request over ``tokens`` that kept ``kept`` positions and ended (cached)."""
    kv = kv_pool.reserve(len(tokens) + 1, list(hit))
    assert kv is not None
    kv_pool.grow(kv, len(tokens))
    kv.length = kept
    pages = list(kv.pages)
    kv_pool.free(kv, tokens)
    return pages


def test_a_match_is_whole_chunks_of_the_same_tokens_after_the_same_prefix() -> None:
    p = pool(16)
    cache = p.cache
    assert cache is not None
    a = seq(100, 3 * PS + 5)
    pages = finished(p, a, kept=3 * PS + 5)
    # Three full chunks cached (the tail of 5 is not a full page), on the table's own pages.
    assert len(cache) == 3 and cache.cached_pages == 3 and cache.idle_pages == 3
    assert [c.pages for c in cache.match(a, len(a))] == [[pages[0]], [pages[1]], [pages[2]]]
    assert len(cache.match(a, 2 * PS + 15)) == 2  # the limit cuts it to whole chunks
    assert len(cache.match(a[: PS + 3] + [7] * 40, 100)) == 1  # diverges in chunk 2
    # The same 16 tokens after another prefix are other K/V: no match.
    shifted = seq(0, PS) + a[:PS]
    assert len(cache.match(shifted, 100)) == 0
    assert cache.match([1, 2, 3], 3) == []


def test_only_kept_positions_with_known_tokens_are_cached() -> None:
    p = pool(16)
    cache = p.cache
    assert cache is not None
    finished(p, seq(0, 4 * PS), kept=2 * PS + 3)  # the K/V past 35 are not kept
    assert len(cache) == 2
    finished(p, seq(1000, 4 * PS)[: 3 * PS], kept=3 * PS)  # tokens known: 48
    assert len(cache) == 5
    assert p.pages_used == 0 and len(p._free) + cache.idle_pages == p.num_pages


def test_admission_counts_the_pages_past_the_hit_and_the_hit_pages_it_pins() -> None:
    p = pool(10)
    cache = p.cache
    assert cache is not None
    a = seq(0, 4 * PS)
    finished(p, a, kept=4 * PS)
    assert p.free_pages == 10  # idle cached pages are reclaimable
    hit = cache.match([*a, 9], 4 * PS)
    assert len(hit) == 4
    kv = p.reserve(4 * PS + 2 * PS, hit)  # 6 pages, 4 of them hit
    assert kv is not None and kv.shared == 4 and kv.length == 4 * PS
    assert kv.pages == [page for c in hit for page in c.pages]
    assert p.reserved_pages == 2 and cache.pinned_pages == 4 and p.free_pages == 4
    # A second request pinning the same chunks costs only its own pages.
    other = p.reserve(4 * PS + 4 * PS, hit)
    assert other is not None and p.reserved_pages == 6 and cache.pinned_pages == 4
    assert p.free_pages == 0
    assert p.reserve(1) is None  # nothing left to promise
    # A hit that leaves no position of the request's own is refused.
    with pytest.raises(ValueError, match="positions of its own"):
        p.reserve(4 * PS, hit)
    p.free(kv, None)
    p.free(other, None)
    assert p.reserved_pages == cache.pinned_pages == 0 and p.free_pages == 10
    assert cache.idle_pages == 4


def test_a_table_never_trims_or_frees_its_shared_pages() -> None:
    p = pool(10)
    cache = p.cache
    assert cache is not None
    a = seq(0, 2 * PS)
    finished(p, a, kept=2 * PS)
    kv = p.reserve(5 * PS, cache.match([*a, 1], 2 * PS))
    assert kv is not None
    shared = kv.pages[:2]
    p.grow(kv, 4 * PS)
    kv.length = 0  # even a table that claims to keep nothing keeps its hit
    p.trim(kv)
    assert kv.pages == shared
    p.free(kv, None)  # aborted without caching: its hit stays cached, unpinned
    assert cache.cached_pages == 2 and cache.pinned_pages == 0
    assert not set(shared) & set(p._free)


def test_a_chunk_cached_twice_keeps_the_older_copy_and_frees_the_other() -> None:
    p = pool(10)
    cache = p.cache
    assert cache is not None
    a = seq(0, 2 * PS)
    one, two = p.reserve(3 * PS), p.reserve(3 * PS)  # both computed the same prompt
    assert one is not None and two is not None
    for kv in (one, two):
        p.grow(kv, 2 * PS)
        kv.length = 2 * PS
    first, second = list(one.pages), list(two.pages)
    p.free(one, a)
    p.free(two, a)
    assert len(cache) == 2 and [c.pages for c in cache.match(a, 32)] == [[first[0]], [first[1]]]
    assert set(second) <= set(p._free)
    assert len(p._free) + cache.idle_pages == p.num_pages


def test_eviction_takes_the_least_recently_used_idle_leaf_and_never_a_pinned_chunk() -> None:
    p = pool(6)
    cache = p.cache
    assert cache is not None
    old, new = seq(0, 2 * PS), seq(500, 2 * PS)
    finished(p, old, kept=2 * PS)
    finished(p, new, kept=2 * PS)
    assert cache.cached_pages == 4 and len(p._free) == 2
    # A request pins `old` (used most recently now) and needs 3 pages of its own: 2 free,
    # then one evicted — the leaf of `new` (least recently used), not its parent first.
    kv = p.reserve(2 * PS + 3 * PS, cache.match([*old, 1], 2 * PS))
    assert kv is not None
    p.grow(kv, 2 * PS + 3 * PS)
    assert cache.evicted_pages == 1
    assert len(cache.match(new, 2 * PS)) == 1 and len(cache.match(old, 2 * PS)) == 2
    # Now the other chunk of `new`; then nothing is left to evict (only pinned chunks).
    assert cache.evict() and len(cache.match(new, 2 * PS)) == 0
    assert not cache.evict()
    assert cache.cached_pages == cache.pinned_pages == 2
    kv.length = 5 * PS
    p.free(kv, old + seq(900, 3 * PS))
    # Its own pages were cached as children of `old`'s chunks; the hit is idle again.
    assert cache.pinned_pages == 0 and len(cache.match(old + seq(900, 3 * PS), 100)) == 5


def test_a_parent_is_evicted_only_after_its_children() -> None:
    p = pool(8)
    cache = p.cache
    assert cache is not None
    a = seq(0, 3 * PS)
    finished(p, a, kept=3 * PS)
    for _ in range(3):
        assert cache.evict()
        # Whatever is left is still a chain from the root: every remaining chunk matches.
        assert len(cache.match(a, 3 * PS)) == len(cache)
    assert len(cache) == 0 and not cache.evict()


def test_block_sized_chunks_for_block_causal_families() -> None:
    p = pool(16, chunk=32)
    cache = p.cache
    assert cache is not None and cache.chunk == 32 and cache.pages_per_chunk == 2
    a = seq(0, 3 * PS)
    finished(p, a, kept=3 * PS)
    assert len(cache) == 1 and cache.cached_pages == 2  # 48 kept: one block of 32
    assert cache.match(a, 31) == [] and len(cache.match(a, 32)) == 1
    with pytest.raises(RuntimeError, match="idle pool"):
        busy = pool(4)
        busy.reserve(PS)
        busy.enable_prefix_cache(PS)


def test_a_running_table_publishes_its_kept_chunks_to_the_cache() -> None:
    p = pool(12)
    cache = p.cache
    assert cache is not None
    a = seq(0, 5 * PS)
    kv = p.reserve(6 * PS)
    assert kv is not None and p.reserved_pages == 6
    p.grow(kv, 3 * PS)
    kv.length = 2 * PS + 5  # two full chunks kept
    calls: list[int] = []

    def ids() -> list[int]:
        calls.append(1)
        return a

    cache.publish(kv, ids)
    # Two chunks change hands: pinned by the table, out of its reservation.
    assert kv.shared == 2 and len(cache) == 2 and cache.pinned_pages == 2
    assert p.reserved_pages == 4 and p.free_pages == 12 - 4 - 2
    cache.publish(kv, ids)  # nothing new kept: the token ids are not even asked for
    assert len(calls) == 1
    # Another table, computing the same prompt alongside, finds its first chunk cached
    # already: it publishes nothing and keeps its own copies until it ends.
    other = p.reserve(6 * PS)
    assert other is not None
    p.grow(other, 4 * PS)
    other.length = 4 * PS
    cache.publish(other, lambda: a)
    assert other.shared == 0 and len(cache) == 2
    kv.length = 3 * PS
    cache.publish(kv, ids)  # the first table goes on publishing its chain
    assert kv.shared == 3 and len(cache) == 3 and p.reserved_pages == 3 + 6
    p.trim(kv)
    p.free(kv, a)
    p.free(other, a)
    assert cache.pinned_pages == 0 and p.reserved_pages == 0 and p.pages_used == 0
    assert len(p._free) + cache.idle_pages == p.num_pages
    # The other table's fourth chunk joined the chain when it ended; its duplicates were freed.
    assert len(cache.match(a, 5 * PS)) == 4


def test_copying_hits_gives_the_table_its_own_pages_holding_the_cached_k_and_v() -> None:
    p = KVPool(2, 1, 2, 8 * PS)
    cache = p.enable_prefix_cache(PS, copy_hits=True)
    p.k.normal_()
    p.v.normal_()
    a = seq(0, 2 * PS)
    cached = finished(p, a, kept=2 * PS)[:2]
    hit = cache.match([*a, 1], 2 * PS)
    kv = p.reserve(4 * PS, hit)
    assert kv is not None and kv.shared == 0 and kv.length == 2 * PS
    assert not set(kv.pages) & set(cached) and len(kv.pages) == 2
    # Queued for the next forward (the runner applies them on every rank, then runs)...
    src = [page * PS + i for page in cached for i in range(PS)]
    dst = kv.slots(0, 2 * PS)
    assert p.copies == [(kv.id, src, dst)]
    assert not torch.equal(p.k[:, dst], p.k[:, src])
    p.apply_copies(p.take_copies())
    assert p.copies == []
    # ...then every layer's K and V of the hit, slot for slot, are in the table's own pages.
    for buffer in (p.k, p.v):
        assert torch.equal(buffer[:, dst], buffer[:, src])
    # The hit is not pinned afterwards; the table reserved all its pages.
    assert cache.pinned_pages == 0 and p.reserved_pages == 4 and cache.idle_pages == 2
    p.free(kv, a)  # its copies are duplicates: freed, the cached chunks stay
    assert len(cache) == 2 and p.pages_used == 0 and p.reserved_pages == 0


def test_a_table_freed_before_its_hit_is_copied_drops_the_copy() -> None:
    p = KVPool(1, 1, 2, 12 * PS)
    cache = p.enable_prefix_cache(PS, copy_hits=True)
    a = seq(0, 2 * PS)
    finished(p, a, kept=2 * PS)
    kv = p.reserve(4 * PS, cache.match([*a, 1], 2 * PS))
    other = p.reserve(4 * PS, cache.match([*a, 2], 2 * PS))
    assert kv is not None and other is not None and len(p.copies) == 2
    p.free(kv, a)  # aborted before any forward: its copy must not land in reused pages
    assert [c[0] for c in p.copies] == [other.id]
    assert len(cache) == 2 and cache.idle_pages == 2  # nothing of it was cached
