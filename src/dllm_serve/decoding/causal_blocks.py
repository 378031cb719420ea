"""Block diffusion over a causal prefix: a tri-mode model's ``diffusion`` mode
(Nemotron-Labs-Diffusion's ``generate``, SGLang's FastDiffuser with ``causal_context``). The
answer is decoded in blocks of ``B`` starting right after the prompt:

1. **Prefill** (causal view): the prompt's K/V are cached; its last logits give the first
   block's *seed*, written at the block's first position (the AR prediction, committed).
2. **Denoise** (diffusion view, bidirectional inside the block, over the cached prefix): each
   step forwards the block ``[seed, …]`` and commits proposals at its masked positions (the
   diffusion view's logits at ``i`` predict ``i`` itself). Nothing of these forwards is kept.
3. **Causal KV refresh** (causal view): once the block has no mask, one causal forward of the
   finished block writes its K/V — the K/V the next blocks attend to — and its last logits give
   the next block's seed. K/V computed in the diffusion view are not what the causal view would
   compute for the same tokens (every position saw the whole block), so they are not a valid
   causal prefix: the model was trained to continue from causal K/V (tested: skipping the
   refresh changes the next logits; with it the cache equals a causal prefill of
   ``prompt + answer``).

The answer is the committed canvas after the prompt, cut at ``max_tokens`` and before the first
stop id; the last block may hold positions past ``max_tokens``, decoded and dropped. The
batched step is the masked-diffusion base's (``blocks.py``), with each prefill and refresh
row's seed in column 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dllm_serve.decoding.blocks import PREFILL, BlockDecoder, DenoiseState
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.decoding.protocol import (
    AttentionKind,
    RowSpec,
    ShardedLogits,
    StepLogits,
    StepResult,
)

DENOISE, REFRESH = "denoise", "refresh"  # with PREFILL: what the next forward does


@dataclass(slots=True, eq=False)
class CausalBlockState(DenoiseState):
    """A ``diffusion``-mode request of a tri-mode model: the canvas ``prompt + mask × n·B``,
    blocks counted from the first answer position; ``phase`` is what the next forward does."""

    block_size: int = 0
    phase: str = PREFILL

    @property
    def active_block(self) -> tuple[int, int]:
        lo = self.prompt_len + self.block * self.block_size
        return lo, lo + self.block_size

    @property
    def is_prefill(self) -> bool:
        return self.phase == PREFILL

    @property
    def row_length(self) -> int:
        if self.phase == PREFILL:  # the prompt past a prefix-cache hit
            return self.prompt_len - (self.kv.length if self.kv is not None else 0)
        return self.block_size


class CausalBlockDiffusionDecoder(BlockDecoder):
    """The ``diffusion`` mode of a tri-mode model, batched (see the module docstring)."""

    def __init__(self, mask_id: int, stop_ids: Sequence[int], block_size: int) -> None:
        if block_size < 1:
            raise ValueError("the block size must be >= 1")
        super().__init__(mask_id, stop_ids)
        self.block_size = block_size

    def _canvas(self, params: DecodingParams) -> int:
        return -(-params.gen_length // self.block_size) * self.block_size

    def kv_tokens(self, prompt_len: int, params: DecodingParams) -> int:
        return prompt_len + self._canvas(params)

    # Prefix reuse (protocol.PrefixReuse): the kept K/V are the causal view's (refreshed).
    prefix_alignment = 1

    def prefix_limit(self, prompt_len: int, params: DecodingParams) -> int:
        """All of the prompt but its last token, whose logits give the first seed."""
        return prompt_len - 1

    def reuse_prefix(self, state: CausalBlockState, tokens: int) -> None:
        """Nothing to change: the prefill forwards the prompt past ``kv.length``."""
        assert state.kv is not None and state.kv.length == tokens and state.phase == PREFILL

    def init_state(
        self, prompt_ids: Sequence[int], params: DecodingParams, device: torch.device | str
    ) -> CausalBlockState:
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("a causal prefix needs a non-empty prompt (it gives the first seed)")
        return self._new_state(
            CausalBlockState, prompt, len(prompt) + self._canvas(params), params, device,
            block_size=self.block_size,
            schedule=[0],  # the prefill commits no masked position (the sampler reads k = 0)
        )  # fmt: skip

    def prepare(self, state: CausalBlockState) -> RowSpec:
        if state.finished or state.kv is None:
            raise RuntimeError("prepare() called on a finished request (or one without KV)")
        kv = state.kv
        if state.phase == PREFILL:  # the prompt past what the span holds (a prefix hit)
            p, done = state.prompt_len, kv.length
            return RowSpec(state.tokens[done:p], done, [p - 1 - done], AttentionKind.CAUSAL, kv)
        lo, hi = state.active_block
        if kv.length != lo:
            raise RuntimeError(f"the causal prefix holds {kv.length} positions, expected {lo}")
        block = state.tokens[lo:hi]
        if state.phase == REFRESH:
            return RowSpec(block, lo, [self.block_size - 1], AttentionKind.CAUSAL, kv)
        offsets = [p - lo for p in state.masked]  # the diffusion view: no logit shift
        return RowSpec(block, lo, offsets, AttentionKind.BIDIRECTIONAL, kv)

    def sample(
        self, states: Sequence[CausalBlockState], logits: torch.Tensor | ShardedLogits | StepLogits
    ) -> torch.Tensor:
        """``[R, M]``: the denoising rows' commits (``mask_id`` where nothing is committed);
        the prefill and refresh rows carry their seed in column 0 (argmax, or an exact sample
        at T > 0, of the causal logits; mask id excluded)."""
        seeding = [s.phase != DENOISE for s in states]
        return self._sample_seeded(states, logits, seeding, sampled=True)

    def _commit_row(self, state: CausalBlockState, row: Sequence[int]) -> StepResult:
        if state.finished or state.kv is None:
            raise RuntimeError("commit() called on a finished request")
        state.nfe += 1
        if state.phase != DENOISE:
            # Prefill or refresh: everything before the next block is now causal K/V.
            if state.phase == REFRESH:
                state.block += 1
            lo, _ = state.active_block
            state.kv.length = lo
            state.tokens[lo] = int(row[0])
            self._accept_seed(state, int(row[0]))
            state.committed += 1
            result = self._finish_or_continue(state, 1)
            if not result.finished:
                self._start_block(state)
            return result
        result = self._finish_or_continue(state, self._commit_masked(state, row))
        if not result.finished and not state.masked:
            state.phase = REFRESH  # the block is final: its causal K/V come next
            state.schedule, state.step = [0], 0
        return result

    def _start_block(self, state: CausalBlockState) -> None:
        """The block's masks (all but its seed) and, for top-k, its schedule over
        ``min(steps, masks)`` steps."""
        lo, hi = state.active_block
        state.phase = DENOISE
        state.step = 0
        state.masked = [p for p in range(lo, hi) if state.tokens[p] == self.mask_id]
        if not state.masked:  # a block of one token is its seed: straight to its refresh
            state.phase, state.schedule = REFRESH, [0]
            return
        self._schedule(state, state.params.steps)
