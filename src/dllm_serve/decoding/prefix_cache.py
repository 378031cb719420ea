"""Block-level prefix KV cache (Fast-dLLM ``generate_with_prefix_cache``, arXiv:2505.22618 §3.3).

Semi-autoregressive decoding finishes blocks left to right, so when block ``k`` (canvas
``[lo, hi)``) starts, every position before ``lo`` is committed and never changes again. Only
the attention *context* of those positions still changes (bidirectional attention lets the
prompt see the later blocks), and Fast-dLLM's observation is that their keys/values move
little within one block. So, per block:

1. **Refresh** (first step of the block): one full forward over the whole canvas, exactly the
   no-cache forward, whose logits drive this step's commits. Its K/V land in the request's KV
   span; the request keeps those of the *committed prefix* ``[0, c)`` (``span.length = c``),
   with ``c = lo − shift`` (below). Nothing from an older block survives: the whole prefix is
   recomputed with the current canvas.
2. **Cached steps** (the rest of the block): forward only ``x[c:]`` (the current block and the
   later, still-masked blocks — up to ``state.visible_end`` with a mask lookahead) at
   positions ``c, c+1, …``, attending to the cached prefix. Their
   K/V are written past the prefix and never kept. The prefix K/V are stale w.r.t. the commits
   made since the refresh — that is the approximation, and it is reset at every block boundary.

Only committed positions are ever kept ("KV trimming"): ``c ≤ lo`` and the previous blocks are
complete, so the masked positions' K/V (which change every step) are never read as a prefix.

``shift`` is 1 for families with shifted logits (Dream, I-DLM), where the logits predicting
position ``j`` come from the hidden state at ``j − 1``. The block's first position ``lo``
therefore needs the hidden state of ``lo − 1``, a committed prefix position; keeping
``lo − 1`` *out* of the prefix and re-forwarding it at every cached step gives it a hidden
state (and fresh K/V) at the cost of one extra token per forward. The prompt is non-empty for
these families, so ``c = lo − 1 ≥ 0``.

With causal attention the prefix K/V do not depend on later tokens, so the cache is exact.
"""

from __future__ import annotations

from dllm_serve.decoding.forward_spec import AttentionKind, RowSpec
from dllm_serve.decoding.state import DenoiseState


def cached_start(state: DenoiseState, shift: int) -> int:
    """``c``: where the active block's cached prefix ends (and the forwarded tokens begin)."""
    lo, _ = state.active_block
    return lo - shift


def prefix_spec(state: DenoiseState, shift: int, attention: AttentionKind) -> RowSpec:
    """The row of one step with a prefix cache.

    Refresh step (nothing cached): the whole canvas. Cached step: ``x[c:]`` against the cached
    ``[0, c)``. Output offsets are relative to the forwarded tokens: position ``j`` is
    predicted at ``j − shift − start``.
    """
    span = state.kv
    assert span is not None
    c = cached_start(state, shift)
    if span.length not in (0, c):
        raise RuntimeError(f"prefix cache holds {span.length} positions, expected {c}")
    start = span.length
    return RowSpec(
        tokens=state.tokens[start : state.visible_end],
        start=start,
        logits_at=[p - shift - start for p in state.masked],
        attention=attention,
        kv=span,
    )


def after_step(state: DenoiseState, shift: int) -> None:
    """Keep the committed prefix of a refresh step (``c`` positions); cached steps keep it."""
    if state.kv is not None and state.kv.length == 0:
        state.kv.length = cached_start(state, shift)


def reset_for_block(state: DenoiseState) -> None:
    """Forget the previous block's prefix; the next forward (the refresh) rebuilds it."""
    if state.kv is not None:
        state.kv.length = 0
