"""Fast-dLLM v2: block diffusion with a token shift, decoded sub-block by sub-block.

The block-diffusion loop of ``blocks.py`` (blocks of ``B`` aligned to position 0,
block-causal prompt prefill, each step forwarding only the active block against the exact KV
cache of the finished ones), changed where Fast-dLLM v2's official ``generate`` differs:

- **Token shift.** The model is an adapted autoregressive one: the distribution of position
  ``j`` is read from the output at ``j − 1``. Inside the active block that output is in the same
  forward; for the block's first position it is the last output of the *previous* block. So
  the first token of every block is not denoised: it is the argmax of the previous block's last
  logit, taken from the forward that writes that block's final K/V (the "write" forward every
  block-diffusion engine spends on a finished block). When the prompt ends exactly on a block
  boundary, the prompt prefill's last logit gives the first answer token the same way. These
  first tokens are greedy at any temperature, as in the official loop (and SGLang's).
  The official shift also lets a block's position 0 reuse its own output; in this loop that
  position always holds a prompt token or a token given as above, so it is never read.
- **Sub-blocks.** A block is decoded in sub-blocks of ``S`` = 8 positions, left to right: a
  step commits only at the masked positions of the first sub-block that still has one, under
  the request's rule (threshold: every position with probability ≥ τ and always the most
  likely one, Fast-dLLM's rule; top-k: the sub-block's share of the block's steps; LocalLeap),
  with the whole block forwarded every step.
- **No fused write.** The write forward of block ``k`` yields block ``k + 1``'s first token,
  which the next block's first denoising step must already see, so the two cannot share a
  forward (``BlockDiffusionDecoder``'s fusion would change the tokens).

NFE per block = its denoising steps + 1 write; + 1 prefill per request whose prompt holds a
whole block. A prompt of exactly one block is prefilled like any longer one (the official
``generate`` tests ``len(prompt) > B`` and then denoises that first answer block without the
prompt in context: a bug, not reproduced).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dllm_serve.decoding.block_diffusion import BlockDiffusionDecoder, BlockState
from dllm_serve.decoding.blocks import (
    DECODE,
    PREFILL,
    WRITE,
)
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.decoding.protocol import (
    RowSpec,
    ShardedLogits,
    StepLogits,
    StepResult,
)


@dataclass(slots=True, eq=False)
class SubBlockState(BlockState):
    """A Fast-dLLM v2 request: :class:`BlockState` plus the sub-block being decoded.

    ``masked`` holds the masked positions of sub-block ``sub_block`` of the active block only
    (what a step may commit); ``seeds`` is True when this row's forward ends a block (the
    prompt prefill on a block boundary, or a write) and its one logit gives the first token of
    the next block, at ``active_block[0]`` once the block has advanced.
    """

    sub_block: int = 0
    seeds: bool = False


class FastDLLMDecoder(BlockDiffusionDecoder):
    """Fast-dLLM v2 decoding with the engine's batched interface (see the module docstring).

    ``sub_block`` must divide ``block_size`` (the family refuses other configs).
    """

    def __init__(
        self, mask_id: int, stop_ids: Sequence[int], block_size: int, *, sub_block: int
    ) -> None:
        if sub_block < 1 or block_size % sub_block:
            raise ValueError(f"the sub-block ({sub_block}) must divide the block ({block_size})")
        super().__init__(mask_id, stop_ids, block_size, fuse_write=False)
        self.sub_block = sub_block

    @property
    def fuse_write(self) -> bool:
        """Always False: a write forward yields the next block's first token (see above)."""
        return False

    @fuse_write.setter
    def fuse_write(self, value: bool) -> None:
        if value:
            raise ValueError(
                "Fast-dLLM v2 cannot fuse a block's write with the next block's first step: "
                "the write forward gives that block's first token"
            )

    def init_state(
        self, prompt_ids: Sequence[int], params: DecodingParams, device: torch.device | str
    ) -> SubBlockState:
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("a model with shifted logits needs a non-empty prompt")
        b = self.block_size
        first_block = len(prompt) // b
        state: SubBlockState = self._new_state(
            SubBlockState, prompt, self._canvas_length(len(prompt), params), params, device,
            block_size=b, block=first_block, phase=PREFILL if first_block else DECODE,
            # On a block boundary the prompt's last logit gives the first answer token.
            seeds=bool(first_block) and len(prompt) % b == 0,
        )  # fmt: skip
        if state.phase == DECODE:
            self._start_block(state)
        else:
            state.schedule = [0]  # the sampler commits nothing in this row (k = 0)
        return state

    def prefix_limit(self, prompt_len: int, params: DecodingParams) -> int:
        """The prompt's whole blocks, less the last one when the prompt ends on a block
        boundary (the prefill's last logit gives the first answer token then)."""
        whole = prompt_len // self.block_size * self.block_size
        return whole - self.block_size if whole and whole == prompt_len else whole

    def prepare(self, state: SubBlockState) -> RowSpec:  # type: ignore[override]
        if state.phase == PREFILL:
            return super().prepare(state)  # the prompt's whole blocks; logit at lo − 1
        if state.finished or state.kv is None:
            raise RuntimeError("prepare() called on a finished request (or one without KV)")
        lo, hi = state.active_block
        if state.kv.length != lo:
            raise RuntimeError(f"block cache holds {state.kv.length} positions, expected {lo}")
        if state.phase == WRITE:  # the finished block's clean tokens; its last logit seeds
            return RowSpec(tokens=state.tokens[lo:hi], start=lo, logits_at=[hi - 1 - lo],
                           kv=state.kv)  # fmt: skip
        # Token shift: position p is read from output p − 1, inside this block (p > lo).
        if state.masked[0] <= lo:
            raise RuntimeError("a block's first position is never masked in this loop")
        offsets = [p - 1 - lo for p in state.masked]
        return RowSpec(tokens=state.tokens[lo:hi], start=lo, logits_at=offsets, kv=state.kv)

    def sample(
        self, states: Sequence[BlockState], logits: torch.Tensor | ShardedLogits | StepLogits
    ) -> torch.Tensor:
        """The shared sampler's commits, plus each seeding row's next-block token in column 0:
        the argmax of its one logit with the mask id excluded (greedy, as the official loop)."""
        seeding = [isinstance(s, SubBlockState) and s.seeds for s in states]
        return self._sample_seeded(states, logits, seeding, sampled=False)

    def _commit_row(self, state: BlockState, row: Sequence[int]) -> StepResult:
        assert isinstance(state, SubBlockState)
        if state.finished or state.kv is None:
            raise RuntimeError("commit() called on a finished request")
        if state.phase == DECODE:
            return self._commit_decode(state, row)
        state.nfe += 1
        lo, hi = state.active_block
        # A prefill keeps the prompt's whole blocks, a write the finished block: either way
        # the cache now ends where the next block starts.
        state.kv.length = lo if state.phase == PREFILL else hi
        if state.phase == WRITE:
            state.block += 1
        if not state.seeds:
            self._start_block(state)
            return StepResult(committed=0, finished=False)
        state.tokens[state.active_block[0]] = row[0]
        self._accept_seed(state, int(row[0]))
        state.seeds = False
        state.committed += 1
        return self._after_commit(state, 1, block_done=False)

    def _commit_decode(self, state: SubBlockState, row: Sequence[int]) -> StepResult:
        state.nfe += 1
        committed = self._commit_masked(state, row)
        lo, hi = state.active_block
        block_done = not state.masked and all(t != self.mask_id for t in state.tokens[lo:hi])
        return self._after_commit(state, committed, block_done=block_done)

    def _after_commit(
        self, state: SubBlockState, committed: int, *, block_done: bool
    ) -> StepResult:
        """Finish on a stop id or the answer budget; else move to the next sub-block with
        masks, or — once the block has none — to its write forward."""
        result = self._finish_or_continue(state, committed)
        if result.finished:
            return result
        if block_done:
            state.phase = WRITE
            state.seeds = True
            state.masked, state.schedule, state.step = [], [0], 0  # a write commits nothing
        elif not state.masked:
            self._start_block(state, state.sub_block + 1 if state.phase == DECODE else 0)
        return result

    def _start_block(self, state: BlockState, sub_block: int = 0) -> None:
        """Decode the active block from its sub-block ``sub_block`` on: the first one (from
        there) that still has a mask, with its masks and, for top-k, its schedule."""
        assert isinstance(state, SubBlockState)
        lo, hi = state.active_block
        s = self.sub_block
        state.phase = DECODE
        state.step = 0
        for index in range(sub_block, (hi - lo) // s):
            start = lo + index * s
            masked = [p for p in range(start, start + s) if state.tokens[p] == self.mask_id]
            if masked:
                state.sub_block, state.masked = index, masked
                break
        else:
            raise RuntimeError("no masked position left in the active block")
        # num_denoising_steps is per block: each of its sub-blocks gets an equal share (at
        # least one step, never more than its masks).
        self._schedule(state, state.params.steps * s // self.block_size)
