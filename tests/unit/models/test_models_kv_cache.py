"""KVCache append/crop/drop invariants, KVBatch, and cached forwards == uncached forwards."""

from __future__ import annotations

import pytest
import torch

from dllm_serve.models.kv_cache import KVBatch, KVCache
from dllm_serve.models.transformer import DecoderTransformer, TransformerConfig

TOL = 1e-5


def kv(t: int, seed: int, layers: int = 2, heads: int = 2, hd: int = 4) -> torch.Tensor:
    return torch.randn(layers, heads, t, hd, generator=torch.Generator().manual_seed(seed))


def test_append_crop_drop_invariants() -> None:
    cache = KVCache(2, 2, 4)
    assert cache.length == 0 and cache.keys.shape == (2, 2, 0, 4)
    k1, v1, k2, v2 = kv(5, 0), kv(5, 1), kv(3, 2), kv(3, 3)
    cache.append(k1, v1)
    cache.append(k2, v2)
    assert cache.length == 8 and cache.capacity >= 8
    assert torch.equal(cache.keys, torch.cat((k1, k2), 2))
    assert torch.equal(cache.values, torch.cat((v1, v2), 2))
    cache.drop(3)  # == crop(5)
    assert cache.length == 5 and torch.equal(cache.keys, k1) and torch.equal(cache.values, v1)
    cache.crop(2)
    assert torch.equal(cache.keys, k1[:, :, :2])
    k3, v3 = kv(4, 4), kv(4, 5)
    cache.append(k3, v3)  # overwrites the dropped suffix
    assert torch.equal(cache.keys, torch.cat((k1[:, :, :2], k3), 2))
    assert torch.equal(cache.values, torch.cat((v1[:, :, :2], v3), 2))
    cache.crop(cache.length)  # no-op
    cache.drop(0)
    assert cache.length == 6
    cache.clear()
    assert cache.length == 0


def test_growth_keeps_contents_and_amortises() -> None:
    cache = KVCache(1, 1, 2)
    parts = [kv(1, i, layers=1, heads=1, hd=2) for i in range(40)]
    capacities = set()
    for p in parts:
        cache.append(p, -p)
        capacities.add(cache.capacity)
    assert torch.equal(cache.keys, torch.cat(parts, 2))
    assert torch.equal(cache.values, -torch.cat(parts, 2))
    assert len(capacities) <= 3  # 16, 32, 64: doubling, not one reallocation per append
    assert cache.nbytes == 2 * cache.capacity * 2 * 4


@pytest.mark.parametrize(("op", "arg"), [("crop", 4), ("crop", -1), ("drop", 4), ("drop", -1)])
def test_out_of_range_refused(op: str, arg: int) -> None:
    cache = KVCache(2, 2, 4)
    cache.append(kv(3, 0), kv(3, 1))
    with pytest.raises(ValueError, match="cannot"):
        getattr(cache, op)(arg)
    assert cache.length == 3


def test_append_shape_checked() -> None:
    cache = KVCache(2, 2, 4)
    with pytest.raises(ValueError, match=r"\[2, 2, T, 4\]"):
        cache.append(kv(3, 0, heads=3), kv(3, 1, heads=3))


def test_batch_view_pads_and_masks() -> None:
    a, b = KVCache(2, 2, 4), KVCache(2, 2, 4)
    a.append(kv(3, 0), kv(3, 1))
    view = KVBatch([a, None, b])
    assert view.prefix_lengths == [3, 0, 0] and view.max_prefix == 3
    assert view.positions(2).tolist() == [[3, 4], [0, 1], [0, 1]]
    assert view.prefix_mask()[:, 0, 0].tolist() == [[True] * 3, [False] * 3, [False] * 3]
    k, v = view.read(1, torch.zeros(3, 2, 2, 4))
    assert k.shape == (3, 2, 3, 4)
    assert torch.equal(k[0], a.keys[1]) and torch.equal(v[0], a.values[1])
    assert not k[1:].any() and not v[1:].any()  # zeros, never stale memory
    with pytest.raises(ValueError, match="without a cache"):
        KVBatch([a, None], write=[1, 1])
    with pytest.raises(ValueError, match="write counts"):
        KVBatch([a], write=[1, 2])


@pytest.fixture(scope="module")
def model() -> DecoderTransformer:
    # Every optional feature on: GQA, q/k/v and o biases, q/k norm, decoupled head_dim, yarn.
    from dllm_serve.models.rope import RopeScaling

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


def ids_for(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed))


def causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()[None, None]


def prefix_then_block(p: int, n: int) -> torch.Tensor:
    mask = torch.ones(1, 1, p + n, p + n, dtype=torch.bool)
    mask[..., :p, p:] = False
    return mask


@pytest.mark.parametrize("kind", ["causal", "block"])
@torch.no_grad()
def test_single_row_prefix_equals_uncached(model: DecoderTransformer, kind: str) -> None:
    p, n = 7, 5
    ids = ids_for(p + n, 1)[None]
    full_mask = causal(p + n) if kind == "causal" else prefix_then_block(p, n)
    want = model(ids, torch.arange(p + n)[None], full_mask)[0, p:]
    cache = KVCache.for_model(model)
    model(ids[:, :p], torch.arange(p)[None], causal(p) if kind == "causal" else None,
          kv_cache=KVBatch([cache], write=p))  # fmt: skip
    view = KVBatch([cache])
    got = model(ids[:, p:], view.positions(n), causal(n) if kind == "causal" else None,
                kv_cache=view)[0]  # fmt: skip
    assert (got - want).abs().max().item() <= TOL
    assert cache.length == p


@pytest.mark.parametrize("kind", ["causal", "block"])
@torch.no_grad()
def test_batch_of_different_prefixes_equals_uncached(model: DecoderTransformer, kind: str) -> None:
    prefixes, news = [0, 9, 4, 13], [6, 3, 6, 1]
    rows = [ids_for(p + n, 10 + r) for r, (p, n) in enumerate(zip(prefixes, news, strict=True))]
    caches = [KVCache.for_model(model) for _ in rows]
    for cache, p, row in zip(caches, prefixes, rows, strict=True):
        if p:
            mask = causal(p) if kind == "causal" else None
            model(row[None, :p], torch.arange(p)[None], mask, kv_cache=KVBatch([cache], write=p))
    width = max(news)
    cur = torch.zeros(len(rows), width, dtype=torch.long)
    keep = torch.zeros(len(rows), width, dtype=torch.bool)
    for r, (p, n) in enumerate(zip(prefixes, news, strict=True)):
        cur[r, :n], keep[r, :n] = rows[r][p:], True
    mask = keep[:, None, None, :].expand(-1, 1, width, width)
    if kind == "causal":
        mask = mask & causal(width)
    view = KVBatch(caches, write=news)  # store the new tokens too
    got = model(cur, view.positions(width), mask, kv_cache=view)
    for r, (p, n) in enumerate(zip(prefixes, news, strict=True)):
        full = causal(p + n) if kind == "causal" else prefix_then_block(p, n)
        want = model(rows[r][None], torch.arange(p + n)[None], full)[0, p:]
        assert (got[r, :n] - want).abs().max().item() <= TOL, r
        assert caches[r].length == p + n


@torch.no_grad()
def test_store_leading_tokens_only_and_trim(model: DecoderTransformer) -> None:
    ids = ids_for(10, 3)[None]
    # Storing 6 of 10 tokens == storing all 10 and dropping 4 (I-DLM's KV trim).
    a, b = KVCache.for_model(model), KVCache.for_model(model)
    model(ids, torch.arange(10)[None], causal(10), kv_cache=KVBatch([a], write=6))
    model(ids, torch.arange(10)[None], causal(10), kv_cache=KVBatch([b], write=10))
    b.drop(4)
    assert a.length == b.length == 6
    assert (a.keys - b.keys).abs().max().item() <= TOL
    assert (a.values - b.values).abs().max().item() <= TOL


@torch.no_grad()
def test_failed_forward_leaves_cache_unchanged(model: DecoderTransformer) -> None:
    cache = KVCache.for_model(model)
    model(ids_for(4, 0)[None], torch.arange(4)[None], kv_cache=KVBatch([cache], write=4))
    before = cache.keys.clone()

    def boom(*_: object) -> None:
        raise RuntimeError("boom")

    handle = model.layers[2].register_forward_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            view = KVBatch([cache], write=3)
            model(ids_for(3, 1)[None], view.positions(3), kv_cache=view)
    finally:
        handle.remove()
    assert cache.length == 4 and torch.equal(cache.keys, before)


@torch.no_grad()
def test_view_is_single_use_and_rows_must_match(model: DecoderTransformer) -> None:
    cache = KVCache.for_model(model)
    view = KVBatch([cache], write=2)
    model(ids_for(2, 0)[None], torch.arange(2)[None], kv_cache=view)
    with pytest.raises(RuntimeError, match="already"):
        model(ids_for(2, 0)[None], torch.arange(2)[None], kv_cache=view)
    with pytest.raises(ValueError, match="rows"):
        model(ids_for(2, 0).expand(2, 2), torch.arange(2).expand(2, 2), kv_cache=KVBatch([cache]))


def test_for_model_matches_dtype_and_shape(model: DecoderTransformer) -> None:
    cache = KVCache.for_model(model, capacity=5)
    cfg = model.config
    assert cache.capacity == 5 and cache.dtype == torch.float32
    assert cache.keys.shape == (cfg.n_layers, cfg.n_kv_heads, 0, cfg.head_dim)
