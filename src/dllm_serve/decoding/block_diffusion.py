"""Block diffusion (SDAR/TraDo): denoise one block at a time against an exact KV cache.

The model was trained block-causal — bidirectional inside blocks of ``B`` tokens aligned to
position 0, causal across blocks — so once a block is final its keys and values never change,
and a decode step forwards only the active block against the cached prefix. Per request:

1. **Prefill** (when the prompt holds whole blocks): one forward over those ``⌊P/B⌋·B`` tokens
   with the block-causal mask, keeping their K/V.
2. **Decode** the active block (the prompt's tail shares the first one, as in training): each
   step forwards the block's ``B`` tokens at their positions against the cached prefix (no
   mask: the block sees the prefix and itself) and commits proposals at its masked positions
   by the request's rule — top-k on a per-block schedule of ``min(steps, masks)`` steps,
   threshold or LocalLeap — exactly as LLaDA denoising does inside its active block
   (``decoding/denoise.py``; the sampler is shared).
3. **Write**: once the block has no mask, its final K/V must be computed from its clean tokens.
   Every engine that serves these models spends one more forward of the clean block on it
   (SGLang, dInfer, LMDeploy, mlx-lm); here (``fuse_write``, the default) it is fused with the
   next block's first step: one block-causal forward over both blocks, in which the finished
   block's queries see the prefix and themselves — the same K/V a separate forward computes —
   and the next block's see the prefix and both. That saves one forward per block (tested:
   the same tokens as the unfused loop and as the no-cache reference).

The answer is the committed canvas after the prompt, cut at ``max_tokens`` and before the
first stop id; the request ends as soon as the contiguous committed answer holds a stop id
(exact: committed tokens never change) or reaches ``max_tokens``. Blocks past the answer
budget are never started; the last block may hold positions past it, decoded and dropped
(the official loop rounds its canvas up to whole blocks the same way).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dllm_serve.decoding.block_steps import commit_masked, finish_or_continue, schedule_block
from dllm_serve.decoding.denoise import LLaDADenoiser
from dllm_serve.decoding.forward_spec import AttentionKind, RowSpec, StepResult
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.decoding.sampling import new_generator
from dllm_serve.decoding.state import DenoiseState
from dllm_serve.decoding.stops import request_stop_ids

PREFILL, DECODE, WRITE = "prefill", "decode", "write"


@dataclass(slots=True, eq=False)
class BlockState(DenoiseState):
    """One block-diffusion request: a denoising state whose blocks are aligned to position 0.

    ``tokens`` is ``prompt + mask × (whole blocks up to max_tokens)`` (the answer budget is
    ``params.gen_length``; positions past it are decoded and dropped); ``block`` indexes the
    active block counted from position 0 and ``block_size`` is the checkpoint's; ``phase`` is
    what the next forward does (prefill the prompt's whole blocks, decode the active block, or
    — unfused — write the finished block's K/V). ``write_pending``: the previous block is final
    and its K/V come with the next forward (fused write).
    """

    block_size: int = 0
    phase: str = DECODE
    write_pending: bool = False

    @property
    def active_block(self) -> tuple[int, int]:
        lo = self.block * self.block_size
        return lo, lo + self.block_size

    @property
    def is_prefill(self) -> bool:
        return self.phase == PREFILL

    @property
    def row_length(self) -> int:
        if self.phase == PREFILL:
            return self.active_block[0]
        return 2 * self.block_size if self.write_pending else self.block_size


class BlockDiffusionDecoder:
    """Block-diffusion decoding with the engine's batched interface (see the module docstring).

    ``block_size`` is the checkpoint's trained block; requests cannot change it (the API
    rejects another ``block_length``). Holds configuration only; the randomness of each request
    comes from its own generator, so batched == solo.
    """

    decoding_mode = "block_diffusion"

    def __init__(
        self, mask_id: int, stop_ids: Sequence[int], block_size: int, *, fuse_write: bool = True
    ) -> None:
        if block_size < 1:
            raise ValueError("the block size must be >= 1")
        self.fuse_write = fuse_write
        self.mask_id = mask_id
        self.stop_ids = tuple(stop_ids)
        self.block_size = block_size
        self._sampler = LLaDADenoiser(mask_id, stop_ids)  # the same proposals and commit rules

    def _canvas_length(self, prompt_len: int, params: DecodingParams) -> int:
        """Prompt + answer budget, rounded up to whole blocks from position 0."""
        b = self.block_size
        return -(-(prompt_len + params.gen_length) // b) * b

    def kv_tokens(self, prompt_len: int, params: DecodingParams) -> int:
        return self._canvas_length(prompt_len, params)

    def init_state(
        self, prompt_ids: Sequence[int], params: DecodingParams, device: torch.device | str
    ) -> BlockState:
        prompt = [int(t) for t in prompt_ids]
        stop_ids = request_stop_ids(self.mask_id, self.stop_ids, params)
        length = self._canvas_length(len(prompt), params)
        first_block = len(prompt) // self.block_size
        state = BlockState(
            tokens=prompt + [self.mask_id] * (length - len(prompt)),
            prompt_len=len(prompt),
            params=params,
            generator=new_generator(params, device),
            mask_id=self.mask_id,
            stop_ids=stop_ids,
            block_size=self.block_size,
            block=first_block,
            phase=PREFILL if first_block else DECODE,
        )
        if state.phase == DECODE:
            self._start_block(state)
        else:
            state.schedule = [0]  # a prefill commits nothing (the sampler reads k = 0)
        return state

    def prepare(self, state: BlockState) -> RowSpec:
        if state.finished or state.kv is None:
            raise RuntimeError("prepare() called on a finished request (or one without KV)")
        lo, hi = state.active_block
        if state.phase == PREFILL:  # the prompt's whole blocks, block-causal, K/V kept
            return RowSpec(
                tokens=state.tokens[:lo], start=0, logits_at=[lo - 1],
                attention=AttentionKind.BLOCK_CAUSAL, kv=state.kv, block=self.block_size,
            )  # fmt: skip
        start = lo - self.block_size if state.write_pending else lo
        if state.kv.length != start:
            raise RuntimeError(f"block cache holds {state.kv.length} positions, expected {start}")
        offsets = [p - start for p in state.masked] if state.phase == DECODE else [0]
        if state.write_pending:
            # The finished block and the active one in one forward, block-causal: the finished
            # block's queries see the prefix and itself (its final K/V, as a separate write
            # forward computes them), the active block's see the prefix and both blocks.
            return RowSpec(
                tokens=state.tokens[start:hi], start=start, logits_at=offsets,
                attention=AttentionKind.BLOCK_CAUSAL, kv=state.kv, block=self.block_size,
            )  # fmt: skip
        return RowSpec(tokens=state.tokens[lo:hi], start=lo, logits_at=offsets, kv=state.kv)

    def sample(self, states: Sequence[BlockState], logits: torch.Tensor) -> torch.Tensor:
        """The committed tokens of every row (LLaDA's batched sampler; prefill and write rows
        have no masked position, so they commit nothing)."""
        return self._sampler.sample(states, logits)  # type: ignore[arg-type]

    def commit(
        self, states: Sequence[BlockState], committed: Sequence[Sequence[int]]
    ) -> list[StepResult]:
        return [self._commit_row(s, row) for s, row in zip(states, committed, strict=True)]

    def _commit_row(self, state: BlockState, row: Sequence[int]) -> StepResult:
        if state.finished or state.kv is None:
            raise RuntimeError("commit() called on a finished request")
        state.nfe += 1
        lo, hi = state.active_block
        if state.phase == PREFILL:
            state.kv.length = lo
            state.phase = DECODE
            self._start_block(state)
            return StepResult(committed=0, finished=False)
        if state.phase == WRITE:  # the block's final K/V are in place: keep them, move on
            state.kv.length = hi
            state.block += 1
            self._start_block(state)
            return StepResult(committed=0, finished=False)
        if state.write_pending:  # the previous block's final K/V came with this forward
            state.kv.length = lo
            state.write_pending = False
        result = finish_or_continue(state, commit_masked(state, row))
        if result.finished:
            return result
        if not state.masked and self.fuse_write:
            # The next block's first step will also write this block's final K/V.
            state.block += 1
            self._start_block(state)
            state.write_pending = True
        elif not state.masked:
            state.phase = WRITE
            state.schedule, state.step = [0], 0  # the write forward commits nothing
        return result

    def _start_block(self, state: BlockState) -> None:
        """The active block's masks and, for top-k, its schedule over ``min(steps, masks)``
        steps (no step that commits nothing)."""
        lo, hi = state.active_block
        state.phase = DECODE
        state.step = 0
        state.masked = [p for p in range(lo, hi) if state.tokens[p] == self.mask_id]
        schedule_block(state, state.params.steps)
