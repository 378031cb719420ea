"""KVPool page allocation, and forwards over a cached prefix in the pool == full forwards."""

from __future__ import annotations

import pytest
import torch

from dllm_serve.decoding.protocol import AttentionKind, RowSpec
from dllm_serve.engine.model_runner import ModelRunner
from dllm_serve.models.attention import AttnGroup, FlatBatch
from dllm_serve.models.kv_pool import KVPages, KVPool
from dllm_serve.models.rope import RopeScaling
from dllm_serve.models.transformer import DecoderTransformer, TransformerConfig

TOL = 1e-5


# ---- the page allocator ------------------------------------------------------------------------


def test_reserve_grow_trim_free_accounting() -> None:
    pool = KVPool(2, 2, 4, 40, page_size=4)
    # 10 pages, then one zero page (its first slot is what masked keys of ragged rows read).
    assert (pool.num_pages, pool.slots, pool.zero_slot, pool.zero_page) == (10, 40, 40, 10)
    assert pool.k.shape == pool.v.shape == (2, 44, 2, 4)
    assert not pool.k.any() and not pool.v.any()  # zeros, never stale memory
    assert pool.nbytes == 2 * 2 * 40 * 2 * 4 * 4
    assert KVPool.bytes_per_slot(2, 2, 4, torch.float32) * pool.slots == pool.nbytes
    a = pool.reserve(10)  # 3 pages promised, none taken yet
    assert a is not None and (a.reserved, a.capacity, a.pages) == (3, 12, [])
    assert (pool.reserved_pages, pool.free_pages, pool.pages_used) == (3, 7, 0)
    pool.grow(a, 6)  # positions 0..5: two pages
    assert len(a.pages) == 2 and pool.pages_used == 2
    assert a.slots(2, 6) == [a.slot(p) for p in range(2, 6)]
    assert a.slot(5) == a.pages[1] * 4 + 1
    with pytest.raises(ValueError, match="overflows its KV reservation"):
        pool.grow(a, 13)
    a.length = 3  # keep positions 0..2: the second page goes back
    pool.trim(a)
    assert len(a.pages) == 1 and pool.pages_used == 1 and pool.reserved_pages == 3
    assert pool.reserve(29) is None  # 8 pages > the 7 unreserved: waits
    b = pool.reserve(28)
    assert b is not None and pool.free_pages == 0
    pool.free(a)
    assert (a.reserved, a.pages, a.length) == (0, [], 0) and pool.reserved_pages == 7
    pool.free(a)  # a no-op: it holds nothing any more
    assert pool.reserved_pages == 7 and pool.free_pages == 3
    pool.free(b)
    assert pool.reserved_pages == pool.pages_used == 0 and pool.free_pages == 10


def test_pages_need_not_be_contiguous() -> None:
    """The contiguous allocator refused what no free interval held; pages have no such limit."""
    pool = KVPool(1, 1, 2, 48, page_size=4)  # 12 pages
    tables = []
    for _ in range(4):
        kv = pool.reserve(12)
        assert kv is not None
        pool.grow(kv, 12)
        tables.append(kv)
    pool.free(tables[0])
    pool.free(tables[2])  # two holes of 3 pages, between held pages
    big = pool.reserve(24)
    assert big is not None
    pool.grow(big, 24)
    assert sorted(big.pages) == sorted([*range(0, 3), *range(6, 9)])
    held = {p for t in (tables[1], tables[3], big) for p in t.pages}
    assert len(held) == 12  # every page held exactly once


def test_invalid_sizes_refused() -> None:
    with pytest.raises(ValueError, match="at least one page"):
        KVPool(1, 1, 2, 15)  # fewer slots than one page of 16
    pool = KVPool(1, 1, 2, 32)
    with pytest.raises(ValueError, match="at least one token"):
        pool.reserve(0)
    assert pool.reserve(33) is None and pool.reserved_pages == 0


# ---- forwards over a cached prefix -------------------------------------------------------------


@pytest.fixture(scope="module")
def model() -> DecoderTransformer:
    # Every optional feature on: GQA, q/k/v and o biases, q/k norm, decoupled head_dim, yarn.
    cfg = TransformerConfig(
        vocab_size=97, d_model=48, n_heads=6, n_kv_heads=2, n_layers=3, mlp_hidden_size=64,
        rope_theta=10000.0, rms_norm_eps=1e-6, tie_embeddings=True, max_sequence_length=256,
        head_dim=10, qkv_bias=True, o_bias=True, qk_norm=True,
        rope_scaling=RopeScaling("yarn", factor=2.0, original_max_position_embeddings=64),
    )  # fmt: skip
    torch.manual_seed(0)
    m = DecoderTransformer(cfg).eval()
    for name, p in m.named_parameters():
        if "norm" in name or name.endswith("bias"):
            p.data.uniform_(0.5, 1.5)
    return m


POOLS: dict[int, KVPool] = {}  # a table's pool, for flat_row to take its pages


class TablePool(KVPool):
    """A pool whose tables remember it (test convenience)."""

    def reserve(self, tokens: int) -> KVPages | None:
        kv = super().reserve(tokens)
        if kv is not None:
            POOLS[id(kv)] = self
        return kv


def new_pool(model: DecoderTransformer, slots: int = 64) -> KVPool:
    cfg = model.config
    return TablePool(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, slots, page_size=4)


def ids_for(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed))


def causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()[None, None]


def prefix_then_block(p: int, n: int) -> torch.Tensor:
    mask = torch.ones(1, 1, p + n, p + n, dtype=torch.bool)
    mask[..., :p, p:] = False
    return mask


def flat_row(
    ids: torch.Tensor, span: KVPages, start: int, is_causal: bool, read_prefix: bool
) -> FlatBatch:
    """One row ``ids`` at positions ``start…`` written to ``span``'s pages; with
    ``read_prefix`` it attends to ``[0, start)`` (built by hand: the model's contract, no
    runner)."""
    n = ids.numel()
    if len(span.pages) * span.page_size < start + n:
        POOLS[id(span)].grow(span, start + n)
    slots = torch.tensor(span.slots(start, start + n))
    if read_prefix:
        keys = torch.tensor(span.slots(0, start + n))[None]
        mask = None
        if is_causal:  # query i sees keys j <= start + i
            mask = (torch.arange(start + n)[None, :] <= torch.arange(n)[:, None] + start)[None]
        group = AttnGroup(0, 1, n, kv_slots=keys, mask=mask)
    else:
        group = AttnGroup(0, 1, n, is_causal=is_causal)
    return FlatBatch(ids, torch.arange(start, start + n), [group], torch.arange(n), slots)


@pytest.mark.parametrize("kind", ["causal", "block"])
@torch.no_grad()
def test_forward_flat_over_a_pool_prefix_equals_the_full_forward(
    model: DecoderTransformer, kind: str
) -> None:
    p, n = 7, 5
    ids = ids_for(p + n, 1)
    is_causal = kind == "causal"
    full_mask = causal(p + n) if is_causal else prefix_then_block(p, n)
    want = model(ids[None], torch.arange(p + n)[None], full_mask)[0, p:]
    pool = new_pool(model)
    first = pool.reserve(5)  # the row's pages do not start at slot 0
    assert first is not None
    pool.grow(first, 5)
    span = pool.reserve(p + n)
    assert span is not None
    model.forward_flat(flat_row(ids[:p], span, 0, is_causal, False), pool)
    span.length = p
    got = model.forward_flat(flat_row(ids[p:], span, p, is_causal, True), pool)
    assert (got - want).abs().max().item() <= TOL
    # Teeth: without its prefix the row is something else.
    alone = model.forward_flat(flat_row(ids[p:], pool.reserve(n), 0, is_causal, False), pool)
    assert (alone - want).abs().max().item() > 100 * TOL


@torch.no_grad()
def test_prefix_keys_are_stored_after_rope(model: DecoderTransformer) -> None:
    """The slot of position t holds token t's key rotated at position t (and after the q/k
    norm), and its value; a later forward reads it as is."""
    n = 6
    ids = ids_for(n, 2)
    pool = new_pool(model)
    first = pool.reserve(3)
    assert first is not None
    pool.grow(first, 3)
    span = pool.reserve(n)
    assert span is not None
    model.forward_flat(flat_row(ids, span, 0, True, False), pool)
    attn = model.layers[0].attn
    h = model.layers[0].attn_norm(model.embed_tokens(ids))
    cos, sin = model.rope(torch.arange(n))
    _, k, v = attn.project(h, cos, sin)
    stored_k = pool.k[0, span.slots(0, n)]
    stored_v = pool.v[0, span.slots(0, n)]
    assert stored_k.shape == (n, model.config.n_kv_heads, model.config.head_dim)
    assert (stored_k - k).abs().max().item() <= TOL
    assert (stored_v - v).abs().max().item() <= TOL
    # Teeth: the unrotated key (position 0 for every token) differs past position 0.
    cos0, sin0 = model.rope(torch.zeros(n, dtype=torch.long))
    _, k0, _ = attn.project(h, cos0, sin0)
    assert (stored_k[0] - k0[0]).abs().max().item() <= TOL
    assert (stored_k[1:] - k0[1:]).abs().max().item() > 100 * TOL


@torch.no_grad()
def test_trimmed_suffix_is_overwritten_by_the_next_write(model: DecoderTransformer) -> None:
    """Keeping 6 of 10 written tokens (I-DLM's KV trim) and then forwarding 4 other tokens
    equals the full causal forward of the 6 kept tokens and the 4 new ones."""
    ids, other = ids_for(10, 3), ids_for(4, 4)
    pool = new_pool(model)
    span = pool.reserve(12)
    assert span is not None
    model.forward_flat(flat_row(ids, span, 0, True, False), pool)
    span.length = 6
    got = model.forward_flat(flat_row(other, span, 6, True, True), pool)
    seq = torch.cat([ids[:6], other])
    want = model(seq[None], torch.arange(10)[None], causal(10))[0, 6:]
    assert (got - want).abs().max().item() <= TOL
    fresh = pool.reserve(10)
    assert fresh is not None
    model.forward_flat(flat_row(seq, fresh, 0, True, False), pool)
    for buf in (pool.k, pool.v):
        kept = buf[:, span.slots(0, 10)]
        assert (kept - buf[:, fresh.slots(0, 10)]).abs().max().item() <= TOL


@torch.no_grad()
def test_failed_forward_leaves_the_kept_prefix_unchanged(model: DecoderTransformer) -> None:
    pool = new_pool(model)
    span = pool.reserve(8)
    assert span is not None
    model.forward_flat(flat_row(ids_for(4, 0), span, 0, True, False), pool)
    span.length = 4
    k_before, v_before = pool.k.clone(), pool.v.clone()

    def boom(*_: object) -> None:
        raise RuntimeError("boom")

    handle = model.layers[2].mlp.register_forward_hook(boom)  # after its K/V were written
    try:
        with pytest.raises(RuntimeError, match="boom"):
            model.forward_flat(flat_row(ids_for(3, 1), span, 4, True, True), pool)
    finally:
        handle.remove()
    kept = span.slots(0, 4)
    assert span.length == 4
    assert torch.equal(pool.k[:, kept], k_before[:, kept])
    assert torch.equal(pool.v[:, kept], v_before[:, kept])
    # Only the failed row's own slots may have been written.
    touched = ((pool.k != k_before).any(dim=(0, 2, 3))).nonzero().flatten().tolist()
    assert set(touched) <= set(span.slots(4, 7))


@pytest.mark.parametrize("kind", [AttentionKind.CAUSAL, AttentionKind.BIDIRECTIONAL])
@torch.no_grad()
def test_rows_of_different_prefixes_equal_uncached(
    model: DecoderTransformer, kind: AttentionKind
) -> None:
    """Through the ModelRunner on the all-features model: ragged prefixes in one forward."""
    runner = ModelRunner(model, torch.device("cpu"), kv_slots=128)
    pool = runner.pool
    assert pool is not None
    is_causal = kind is AttentionKind.CAUSAL
    prefixes, news = [0, 9, 4, 13], [6, 3, 6, 6]
    rows_ids = [ids_for(p + n, 10 + r) for r, (p, n) in enumerate(zip(prefixes, news, strict=True))]
    rows = []
    for ids, p, n in zip(rows_ids, prefixes, news, strict=True):
        span = pool.reserve(p + n)
        assert span is not None
        if p:
            runner.run([RowSpec(ids[:p].tolist(), 0, [0], kind, kv=span)])
            span.length = p
        rows.append(RowSpec(ids[p:].tolist(), p, list(range(n)), kind, kv=span))
    got = runner.run(rows)
    for r, (ids, p, n) in enumerate(zip(rows_ids, prefixes, news, strict=True)):
        full = causal(p + n) if is_causal else prefix_then_block(p, n)
        want = model.lm_head(model(ids[None], torch.arange(p + n)[None], full)[0, p:])
        assert (got[r, :n] - want).abs().max().item() <= TOL, r
