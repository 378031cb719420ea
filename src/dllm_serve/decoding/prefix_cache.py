"""Block-level prefix KV cache (Fast-dLLM ``generate_with_prefix_cache``, arXiv:2505.22618 §3.3).

Semi-autoregressive decoding finishes blocks left to right, so when block ``k`` (canvas
``[lo, hi)``) starts, every position before ``lo`` is committed and never changes again. Only
the attention *context* of those positions still changes (bidirectional attention lets the
prompt see the later blocks), and Fast-dLLM's observation is that their keys/values move
little within one block. So, per block:

1. **Refresh** (first step of the block): one full forward over the whole canvas, exactly the
   no-cache forward, whose logits drive this step's commits. As a side effect the keys/values
   of the *committed prefix* ``[0, c)`` are stored in the request's cache, with
   ``c = lo − shift`` (below). The cache is emptied first, so nothing from an older block
   survives: the whole prefix is recomputed with the current canvas.
2. **Cached steps** (the rest of the block): forward only ``x[c:]`` (the current block and the
   later, still-masked blocks) at positions ``c, c+1, …``, attending to the cached prefix;
   nothing is written. The prefix K/V are stale w.r.t. the commits made since the refresh —
   that is the approximation, and it is reset at every block boundary.

Only committed positions ever live in the cache ("KV trimming"): ``c ≤ lo`` and the previous
blocks are complete, so the masked positions' K/V (which change every step) are never kept.

``shift`` is 1 for families with shifted logits (Dream, I-DLM), where the logits predicting
position ``j`` come from the hidden state at ``j − 1``. The block's first position ``lo``
therefore needs the hidden state of ``lo − 1``, a committed prefix position; keeping
``lo − 1`` *out* of the cache and re-forwarding it at every cached step gives it a hidden
state (and fresh K/V) at the cost of one extra token per forward. The prompt is non-empty for
these families, so ``c = lo − 1 ≥ 0``.

With causal attention the prefix K/V do not depend on later tokens, so the cache is exact.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dllm_serve.decoding.forward_spec import AttentionKind, ForwardSpec
from dllm_serve.decoding.state import DenoiseState
from dllm_serve.models.kv_cache import KVCache

# Builds an empty cache for the serving model with room for ``capacity`` positions, e.g.
# ``functools.partial(KVCache.for_model, model)``.
KVCacheFactory = Callable[[int], KVCache]


def max_prefix_length(prompt_len: int, gen_length: int, block_length: int, shift: int) -> int:
    """The longest prefix the cache will hold: the one of the last block, ``lo_last − shift``."""
    return max(prompt_len + gen_length - block_length - shift, 0)


def cached_start(state: DenoiseState, shift: int) -> int:
    """``c``: where the active block's cached prefix ends (and the forwarded tokens begin)."""
    lo, _ = state.active_block
    return lo - shift


def reset_for_block(state: DenoiseState) -> None:
    """Forget the previous block's prefix; the next forward (the refresh) rebuilds it."""
    if state.kv_cache is not None:
        state.kv_cache.clear()  # keeps the buffer, so the refresh does not reallocate


def prefix_spec(
    state: DenoiseState, masked: torch.Tensor, shift: int, attention: AttentionKind
) -> ForwardSpec:
    """The forward of one step with a prefix cache (``masked``: the block's masked positions).

    Refresh step (the cache is empty): the whole canvas, writing the K/V of ``[0, c)``.
    Cached step: ``x[c:]`` against the cached ``[0, c)``, writing nothing. Logit indices are
    relative to the forwarded tokens: position ``j`` is predicted at ``j − shift − start``.
    """
    cache = state.kv_cache
    assert cache is not None
    canvas = state.canvas
    c = cached_start(state, shift)
    refresh = cache.length == 0
    if not refresh and cache.length != c:
        raise RuntimeError(f"prefix cache holds {cache.length} positions, expected {c}")
    start = 0 if refresh else c
    return ForwardSpec(
        input_ids=canvas[start:],  # a view: the forward runs before update() mutates it
        positions=torch.arange(start, canvas.numel(), device=canvas.device),
        logits_index=masked - shift - start,
        attention=attention,
        kv_cache=cache,
        kv_write=c if refresh else 0,
    )


def release(state: DenoiseState) -> None:
    """Drop the request's cache (finished): its memory is freed with the last reference."""
    state.kv_cache = None
