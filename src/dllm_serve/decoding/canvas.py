"""LLaDA-style canvas denoising (LLaDA, Dream; I-DLM checkpoints served as plain diffusion
models), batched: every running request advances in one tensor pass.

**Block-level prefix KV cache** (``--kv-cache prefix``; Fast-dLLM ``generate_with_prefix_cache``,
arXiv:2505.22618 §3.3).
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

**Across requests** (``--kv-cache prefix --enable-prefix-caching``, opt-in): a request whose
prompt starts with token ids an ended request kept takes those pages (``models/prefix_cache.py``)
and never recomputes them: each block's refresh forwards the canvas from the end of the hit
(``state.reused``) instead of from 0. That extends the approximation twice: the reused K/V were
computed beside another request's canvas, and this request's refreshes no longer update them.
A request publishes its kept pages only when it ends (:attr:`LLaDADenoiser.refreshes_prefix`):
while it runs, its refreshes rewrite them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dllm_serve.decoding.blocks import BlockDecoder, DenoiseState
from dllm_serve.decoding.commit_rules import block_schedule
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.decoding.protocol import AttentionKind, RowSpec, StepResult


class LLaDADenoiser(BlockDecoder):
    """Semi-autoregressive masked-diffusion sampling (LLaDA), with three commit rules.

    The answer region of ``G`` masks is split into ``G / block_length`` blocks decoded left to
    right. At every step the model sees the whole canvas; for each still-masked position of
    the active block we propose ``x0`` (argmax at T = 0, else a Gumbel-max sample from
    ``softmax(z / T)``) and score it with the request's confidence metric. Which proposals are
    committed depends on ``params.mode``:

    - ``topk``: the block gets ``steps_per_block`` steps and a schedule ``k_0..k_{s-1}``
      summing to its mask count; step ``i`` commits the ``k_i`` most confident proposals and
      the rest stay masked ("low-confidence remasking"). With the uniform schedule and
      ``top1_prob`` this is exactly LLaDA's reference ``generate()``, restricted to the
      positions it could commit (it sets every other confidence to ``-inf``).
    - ``threshold`` (Fast-dLLM) and ``local_leap``: see ``commit_rules.py``; each step commits
      at least one token, so a block takes between 1 and ``block_length`` forwards.

    Family rules: with ``logit_shift`` (Dream, I-DLM) the logits that predict position ``j``
    come from position ``j − 1``; with ``bidirectional=False`` the forward is causal.

    Mask lookahead (``mask_lookahead``, None by default = the reference): a forward includes
    the prompt, the committed blocks, the active block and at most that many masks after it.
    Positions after the active block are all masks, so this only drops MASK keys; a model
    trained on canvases of one block (the demos) then reads a 1024-token canvas block by
    block exactly as it reads a one-block canvas, and a forward costs a block, not a canvas.

    Prefix KV cache (``prefix_cache``; the module docstring): the first step of each
    block is the full forward and keeps the committed prefix's keys and values; the block's
    other steps forward only the canvas from the block on. Commit rules, schedules and the
    early stop are unchanged: only the logits differ (Fast-dLLM's approximation).

    One step for a batch of requests: :meth:`prepare` (host only: each row's tokens and the
    positions whose logits it needs — the masked positions of its active block, which the
    host copy of the canvas knows) → the forward → :meth:`sample` (tensor in, tensor out: the
    proposals and commits of every row at once, ``[R, M]`` tokens, ``mask_id`` where nothing
    was committed) → one device→host copy by the caller → :meth:`commit` (host: write the
    tokens, advance blocks, detect the end). The denoiser holds only configuration; every
    request's randomness comes from its own generator, so a row's result never depends on its
    batch-mates.
    """

    decoding_mode = "diffusion"

    def __init__(
        self,
        mask_id: int,
        stop_ids: Sequence[int],
        *,
        logit_shift: bool = False,
        bidirectional: bool = True,
        prefix_cache: bool = False,
        mask_lookahead: int | None = None,
    ) -> None:
        super().__init__(mask_id, stop_ids)
        self.logit_shift = logit_shift
        self.bidirectional = bidirectional
        self.attention = AttentionKind.BIDIRECTIONAL if bidirectional else AttentionKind.CAUSAL
        self.prefix_cache = prefix_cache
        if mask_lookahead is not None and mask_lookahead < 0:
            raise ValueError("mask_lookahead must be >= 0 (None: the whole canvas)")
        self.mask_lookahead = mask_lookahead
        self._shift = 1 if logit_shift else 0

    # ---- lifecycle -----------------------------------------------------------------------------
    def init_state(
        self, prompt_ids: Sequence[int], params: DecodingParams, device: torch.device | str
    ) -> DenoiseState:
        """The canvas ``[prompt ; mask × gen_length ; suffix]`` and the request's generator.

        Infilling (``params.suffix_ids``): the suffix follows the canvas at the next positions
        and every forward includes it (no mask lookahead: the canvas must see it), so with
        bidirectional attention the canvas is denoised between the prompt and the suffix."""
        prompt = [int(t) for t in prompt_ids]
        if self.logit_shift and not prompt:
            # The first answer position is predicted from the last prompt position.
            raise ValueError("a model with shifted logits needs a non-empty prompt")
        if params.suffix_ids and not self.bidirectional:
            raise ValueError("a suffix needs bidirectional attention (the canvas must see it)")
        state: DenoiseState = self._new_state(
            DenoiseState, prompt, len(prompt) + params.gen_length, params, device,
            mask_lookahead=None if params.suffix_ids else self.mask_lookahead,
        )  # fmt: skip
        state.tokens.extend(params.suffix_ids)
        self._start_block(state)
        return state

    # Prefix reuse across requests (protocol.PrefixReuse), only with the prefix cache and
    # only on request (engine._prefix_cache): approximate, as the module docstring says.
    prefix_alignment = 1
    prefix_reuse_exact = False

    @property
    def refreshes_prefix(self) -> bool:
        """Whether a running request rewrites its kept K/V (each block's refresh): the
        engine caches its pages only when it ends."""
        return self.prefix_cache

    def prefix_limit(self, prompt_len: int, params: DecodingParams) -> int:
        """The prompt but the positions the first block's refresh must forward: the last one
        for shifted families (it predicts the first answer position)."""
        return prompt_len - self._shift if self.prefix_cache else 0

    def reuse_prefix(self, state: DenoiseState, tokens: int) -> None:
        """Every refresh of ``state`` starts past the ``tokens`` positions of the hit."""
        assert state.kv is not None and state.kv.length == tokens
        state.reused = tokens

    def kv_tokens(self, prompt_len: int, params: DecodingParams) -> int:
        """KV-pool slots a request needs: its whole canvas (suffix included) with the prefix
        cache, else none."""
        if not self.prefix_cache:
            return 0
        return prompt_len + params.gen_length + len(params.suffix_ids)

    # ---- one step ------------------------------------------------------------------------------
    def prepare(self, state: DenoiseState) -> RowSpec:
        """The row: the whole canvas (or, with a prefix cache, the part after the prefix);
        logits for the active block's masked positions."""
        if state.finished:
            raise RuntimeError("prepare() called on a finished request")
        if state.kv is not None:
            return prefix_spec(state, self._shift, self.attention)
        window = state.mask_lookahead is not None
        return RowSpec(
            tokens=state.tokens[: state.visible_end] if window else state.tokens,
            start=0,
            # Shifted families predict position j at j − 1; j − 1 ≥ prompt_len − 1 ≥ 0.
            logits_at=[p - self._shift for p in state.masked],
            attention=self.attention,
        )

    def _commit_row(self, state: DenoiseState, row: Sequence[int]) -> StepResult:
        if state.finished:
            raise RuntimeError("commit() called on a finished request")
        scheduled = state.schedule[state.step] if state.params.mode == "topk" else None
        committed = self._commit_masked(state, row)
        # The schedule sums to the block's mask count and each step commits exactly its entry,
        # so the masks left always cover it.
        # A constrained row (structured output) commits its valid run instead and reschedules.
        assert state.constraint is not None or scheduled in (None, committed), (
            "schedule out of sync with the canvas"
        )
        state.nfe += 1
        after_step(state, self._shift)
        # Exact early stop: the answer is the canvas cut before its first stop id. Every
        # position up to and including that stop id is committed, and committed tokens never
        # change, so no later step can alter the answer; decoding the rest of the canvas would
        # only fill positions that are discarded anyway. Likewise once the whole answer is
        # committed: trailing zero-commit steps of the last block (steps_per_block >
        # block_length) would change nothing, nor would canvas positions past an answer limit.
        result = self._finish_or_continue(state, committed)
        if result.finished:
            return result
        # A block is done when it has no mask left. In top-k mode that can come before its
        # schedule ends: with more steps per block than positions, the uniform schedule's
        # zero-commit steps come last, and they would change nothing (no noise is drawn for
        # them either), so the next block starts at once, as in the last block above.
        if not state.masked:
            state.block += 1
            state.step = 0
            self._start_block(state)
        return result

    # ---- one request at a time (tests, simple drivers) -------------------------------------------
    def update(self, state: DenoiseState, logits: torch.Tensor) -> StepResult:
        """:meth:`sample` + :meth:`commit` for one row, ``logits`` ``[len(masked), V]``."""
        if state.finished:
            raise RuntimeError("update() called on a finished request")
        if logits.dim() != 2 or logits.shape[0] != len(state.masked):
            raise ValueError(
                f"expected logits [{len(state.masked)}, V] for the positions prepare() returned, "
                f"got {tuple(logits.shape)}"
            )
        committed = self.sample([state], logits[None].clone()).tolist()
        return self.commit([state], committed)[0]

    # ---- helpers -------------------------------------------------------------------------------
    def _start_block(self, state: DenoiseState) -> None:
        """Empty the prefix cache (the block's first forward refreshes it), list the block's
        masks and compute its schedule (top-k mode only). Blocks are committed left to right
        and only the active block receives commits, so a new block is all masks."""
        reset_for_block(state)
        lo, hi = state.active_block
        state.masked = list(range(lo, hi))
        if state.params.mode != "topk":
            state.schedule = []
            return
        state.schedule = block_schedule(
            state.params.block_schedule, len(state.masked), state.params.steps_per_block
        )


# ---- prefix KV cache ---------------------------------------------------------------------------


def cached_start(state: DenoiseState, shift: int) -> int:
    """``c``: where the active block's cached prefix ends (and the forwarded tokens begin)."""
    lo, _ = state.active_block
    return lo - shift


def prefix_spec(state: DenoiseState, shift: int, attention: AttentionKind) -> RowSpec:
    """The row of one step with a prefix cache.

    Refresh step (nothing cached past a reused prefix): the whole canvas after ``reused``.
    Cached step: ``x[c:]`` against the cached ``[0, c)``. Output offsets are relative to the
    forwarded tokens: position ``j`` is predicted at ``j − shift − start``.
    """
    span = state.kv
    assert span is not None
    c = cached_start(state, shift)
    if span.length not in (state.reused, c):
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
    if state.kv is not None and state.kv.length == state.reused:
        state.kv.length = cached_start(state, shift)


def reset_for_block(state: DenoiseState) -> None:
    """Forget the previous block's prefix; the next forward (the refresh) rebuilds it past
    what another request computed (``reused``)."""
    if state.kv is not None:
        state.kv.length = state.reused
