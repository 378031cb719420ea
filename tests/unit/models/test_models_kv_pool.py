"""KVPool span allocation, and forwards over a cached prefix in the pool == full forwards."""

from __future__ import annotations

import pytest
import torch

from dllm_serve.decoding.protocol import AttentionKind, RowSpec
from dllm_serve.engine.model_runner import ModelRunner
from dllm_serve.models.flat_batch import AttnGroup, FlatBatch
from dllm_serve.models.kv_pool import KVPool, KVSpan
from dllm_serve.models.rope import RopeScaling
from dllm_serve.models.transformer import DecoderTransformer, TransformerConfig

TOL = 1e-5


def free_list(pool: KVPool) -> list[tuple[int, int]]:
    return list(pool._free)  # (start, size) intervals, sorted


# ---- the allocator -----------------------------------------------------------------------------


def test_allocate_first_fit_and_accounting() -> None:
    pool = KVPool(2, 2, 4, 10)
    # 10 allocatable slots and one that stays zero (what masked keys of ragged rows read).
    assert pool.k.shape == pool.v.shape == (2, 11, 2, 4) and pool.zero_slot == 10
    assert not pool.k.any() and not pool.v.any()  # zeros, never stale memory
    assert pool.nbytes == 2 * 2 * 10 * 2 * 4 * 4
    assert KVPool.bytes_per_slot(2, 2, 4, torch.float32) * pool.slots == pool.nbytes
    assert KVPool.bytes_per_slot(2, 2, 4, torch.bfloat16) == 2 * 2 * 2 * 4 * 2
    a, b, c = pool.allocate(3), pool.allocate(4), pool.allocate(3)
    assert a is not None and b is not None and c is not None
    assert [(s.start, s.capacity, s.length) for s in (a, b, c)] == [(0, 3, 0), (3, 4, 0), (7, 3, 0)]
    assert pool.used == 10 and pool.free_slots == 0 and pool.largest_free_span == 0
    assert pool.allocate(1) is None  # full
    pool.free(b)
    assert pool.used == 6 and free_list(pool) == [(3, 4)]
    d = pool.allocate(2)  # first fit: the hole at 3
    assert d is not None and (d.start, d.capacity) == (3, 2)
    assert free_list(pool) == [(5, 2)]


def test_fragmentation_refuses_what_no_interval_holds() -> None:
    pool = KVPool(1, 1, 2, 12)
    spans = [pool.allocate(3) for _ in range(4)]
    assert all(s is not None for s in spans)
    pool.free(spans[0])
    pool.free(spans[2])
    assert pool.free_slots == 6 and pool.largest_free_span == 3
    assert pool.allocate(4) is None  # 6 slots free, but no 4 of them contiguous
    assert pool.used == 6  # a refused allocation changes nothing
    e = pool.allocate(3)
    assert e is not None and e.start == 0  # the first interval that fits


def test_free_merges_left_right_and_both() -> None:
    pool = KVPool(1, 1, 2, 10)
    a, b, c, d = (pool.allocate(n) for n in (2, 3, 2, 3))
    assert a and b and c and d and free_list(pool) == []
    pool.free(a)
    assert free_list(pool) == [(0, 2)]
    pool.free(b)  # merges with its left neighbour
    assert free_list(pool) == [(0, 5)]
    pool.free(d)  # no neighbour free: a separate interval
    assert free_list(pool) == [(0, 5), (7, 3)]
    pool.free(c)  # merges both ways
    assert free_list(pool) == [(0, 10)] and pool.used == 0
    e, f = pool.allocate(4), pool.allocate(4)
    assert e and f
    pool.free(f)  # merges with the free tail on its right
    assert free_list(pool) == [(4, 6)]
    whole = [pool.allocate(6)]
    assert whole[0] is not None and pool.free_slots == 0


def test_a_freed_span_cannot_be_freed_twice() -> None:
    pool = KVPool(1, 1, 2, 8)
    a, b = pool.allocate(4), pool.allocate(4)
    assert a is not None and b is not None
    a.length = 3
    pool.free(a)
    assert (a.capacity, a.length) == (0, 0) and pool.used == 4
    pool.free(a)  # a no-op: the span holds no slots any more
    assert pool.used == 4 and free_list(pool) == [(0, 4)]
    c = pool.allocate(4)  # the slots went back exactly once: one new span fits, no more
    assert c is not None and c.start == 0 and pool.allocate(1) is None


def test_invalid_sizes_refused() -> None:
    with pytest.raises(ValueError, match="at least one slot"):
        KVPool(1, 1, 2, 0)
    pool = KVPool(1, 1, 2, 4)
    with pytest.raises(ValueError, match="at least one slot"):
        pool.allocate(0)
    assert pool.allocate(5) is None and pool.used == 0


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


def new_pool(model: DecoderTransformer, slots: int = 64) -> KVPool:
    cfg = model.config
    return KVPool(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, slots)


def ids_for(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed))


def causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()[None, None]


def prefix_then_block(p: int, n: int) -> torch.Tensor:
    mask = torch.ones(1, 1, p + n, p + n, dtype=torch.bool)
    mask[..., :p, p:] = False
    return mask


def flat_row(
    ids: torch.Tensor, span: KVSpan, start: int, is_causal: bool, read_prefix: bool
) -> FlatBatch:
    """One row ``ids`` at positions ``start…`` written to ``span``; with ``read_prefix`` it
    attends to the span's ``[0, start)`` (built by hand: the model's contract, no runner)."""
    n = ids.numel()
    slots = torch.arange(span.start + start, span.start + start + n)
    if read_prefix:
        keys = torch.arange(span.start, span.start + start + n)[None]
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
    pool.allocate(5)  # the row's span does not start at slot 0
    span = pool.allocate(p + n)
    assert span is not None and span.start == 5
    model.forward_flat(flat_row(ids[:p], span, 0, is_causal, False), pool)
    span.length = p
    got = model.forward_flat(flat_row(ids[p:], span, p, is_causal, True), pool)
    assert (got - want).abs().max().item() <= TOL
    # Teeth: without its prefix the row is something else.
    alone = model.forward_flat(flat_row(ids[p:], pool.allocate(n), 0, is_causal, False), pool)
    assert (alone - want).abs().max().item() > 100 * TOL


@torch.no_grad()
def test_prefix_keys_are_stored_after_rope(model: DecoderTransformer) -> None:
    """Slot ``span.start + t`` holds token t's key rotated at position t (and after the
    q/k norm), and its value; a later forward reads it as is."""
    n = 6
    ids = ids_for(n, 2)
    pool = new_pool(model)
    pool.allocate(3)
    span = pool.allocate(n)
    assert span is not None
    model.forward_flat(flat_row(ids, span, 0, True, False), pool)
    attn = model.layers[0].attn
    h = model.layers[0].attn_norm(model.embed_tokens(ids))
    cos, sin = model.rope(torch.arange(n))
    _, k, v = attn.project(h, cos, sin)
    stored_k = pool.k[0, span.start : span.start + n]
    stored_v = pool.v[0, span.start : span.start + n]
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
    span = pool.allocate(12)
    assert span is not None
    model.forward_flat(flat_row(ids, span, 0, True, False), pool)
    span.length = 6
    got = model.forward_flat(flat_row(other, span, 6, True, True), pool)
    seq = torch.cat([ids[:6], other])
    want = model(seq[None], torch.arange(10)[None], causal(10))[0, 6:]
    assert (got - want).abs().max().item() <= TOL
    fresh = pool.allocate(10)
    assert fresh is not None
    model.forward_flat(flat_row(seq, fresh, 0, True, False), pool)
    for buf in (pool.k, pool.v):
        kept = buf[:, span.start : span.start + 10]
        assert (kept - buf[:, fresh.start : fresh.start + 10]).abs().max().item() <= TOL


@torch.no_grad()
def test_failed_forward_leaves_the_kept_prefix_unchanged(model: DecoderTransformer) -> None:
    pool = new_pool(model)
    span = pool.allocate(8)
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
    kept = slice(span.start, span.start + 4)
    assert span.length == 4
    assert torch.equal(pool.k[:, kept], k_before[:, kept])
    assert torch.equal(pool.v[:, kept], v_before[:, kept])
    # Only the failed row's own slots may have been written.
    touched = ((pool.k != k_before).any(dim=(0, 2, 3))).nonzero().flatten().tolist()
    assert set(touched) <= set(range(span.start + 4, span.start + 7))


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
        span = pool.allocate(p + n)
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
