"""Block diffusion over a causal prefix, with the causal KV refresh (a tri-mode model's
``diffusion`` mode; Nemotron-Labs-Diffusion's ``generate``, SGLang's FastDiffuser with
``causal_context``).

The answer is decoded in blocks of ``B`` (the checkpoint's ``block_size``) starting right after
the prompt. Per request:

1. **Prefill** (causal view): the prompt's K/V are cached; its last logits give the first
   block's *seed*, written at the block's first position (the AR prediction, committed).
2. **Denoise** (diffusion view, bidirectional inside the block, over the cached prefix): each
   step forwards the block ``[seed, …]`` and commits proposals at its masked positions by the
   request's rule (top-k on ``min(steps, masks)`` steps per block, or the confidence threshold,
   LLaDA's sampler; the diffusion view's logits at ``i`` predict ``i`` itself). Nothing of
   these forwards is kept.
3. **Causal KV refresh** (causal view): once the block has no mask, one causal forward of the
   finished block writes its K/V — the K/V the next blocks attend to — and its last logits give
   the next block's seed. The refresh is needed because K/V computed in the diffusion view are
   not what the causal view would compute for the same tokens (every position saw the whole
   block), so they are not a valid causal prefix: the model was trained to continue from
   causal K/V (tested: skipping it changes the next logits; with it the cache equals a fresh
   causal prefill of ``prompt + answer``).

The request ends as soon as the contiguous committed answer holds a stop id or reaches
``max_tokens``; the last block may hold positions past ``max_tokens``, decoded and dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dllm_serve.decoding.block_steps import commit_masked, finish_or_continue, schedule_block
from dllm_serve.decoding.denoise import LLaDADenoiser
from dllm_serve.decoding.forward_spec import AttentionKind, RowSpec, StepResult
from dllm_serve.decoding.host_values import to_device
from dllm_serve.decoding.isd_verify import target_probs
from dllm_serve.decoding.linear_spec import sample_inverse_cdf
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.decoding.sampling import new_generator
from dllm_serve.decoding.sharded_vocab import ShardedLogits, dense_rows, seed_tokens
from dllm_serve.decoding.state import DenoiseState
from dllm_serve.decoding.stops import request_stop_ids

PREFILL, DENOISE, REFRESH = "prefill", "denoise", "refresh"


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
        return self.prompt_len if self.phase == PREFILL else self.block_size


class CausalBlockDiffusionDecoder:
    """The ``diffusion`` mode of a tri-mode model, batched (see the module docstring)."""

    decoding_mode = "block_diffusion"

    def __init__(self, mask_id: int, stop_ids: Sequence[int], block_size: int) -> None:
        if block_size < 1:
            raise ValueError("the block size must be >= 1")
        self.mask_id = mask_id
        self.stop_ids = tuple(stop_ids)
        self.block_size = block_size
        self._sampler = LLaDADenoiser(mask_id, stop_ids)  # the same proposals and commit rules

    def _canvas(self, params: DecodingParams) -> int:
        return -(-params.gen_length // self.block_size) * self.block_size

    def kv_tokens(self, prompt_len: int, params: DecodingParams) -> int:
        return prompt_len + self._canvas(params)

    def init_state(
        self, prompt_ids: Sequence[int], params: DecodingParams, device: torch.device | str
    ) -> CausalBlockState:
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("a causal prefix needs a non-empty prompt (it gives the first seed)")
        stop_ids = request_stop_ids(self.mask_id, self.stop_ids, params)
        return CausalBlockState(
            tokens=prompt + [self.mask_id] * self._canvas(params),
            prompt_len=len(prompt),
            params=params,
            generator=new_generator(params, device),
            mask_id=self.mask_id,
            stop_ids=stop_ids,
            block_size=self.block_size,
            schedule=[0],  # the prefill commits no masked position (the sampler reads k = 0)
        )

    def prepare(self, state: CausalBlockState) -> RowSpec:
        if state.finished or state.kv is None:
            raise RuntimeError("prepare() called on a finished request (or one without KV)")
        kv = state.kv
        if state.phase == PREFILL:
            p = state.prompt_len
            return RowSpec(state.tokens[:p], 0, [p - 1], AttentionKind.CAUSAL, kv)
        lo, hi = state.active_block
        if kv.length != lo:
            raise RuntimeError(f"the causal prefix holds {kv.length} positions, expected {lo}")
        block = state.tokens[lo:hi]
        if state.phase == REFRESH:
            return RowSpec(block, lo, [self.block_size - 1], AttentionKind.CAUSAL, kv)
        offsets = [p - lo for p in state.masked]  # the diffusion view: no logit shift
        return RowSpec(block, lo, offsets, AttentionKind.BIDIRECTIONAL, kv)

    def sample(
        self, states: Sequence[CausalBlockState], logits: torch.Tensor | ShardedLogits
    ) -> torch.Tensor:
        """``[R, M]``: the denoising rows' commits (LLaDA's sampler, ``mask_id`` where nothing
        is committed); the prefill and refresh rows carry their seed in column 0 (argmax, or an
        exact sample at T > 0, of the causal logits; mask id excluded)."""
        seed_rows = [r for r, s in enumerate(states) if s.phase != DENOISE]
        seeds = None
        if seed_rows:  # one argmax for every row (mask id excluded); only seed rows use it
            seeds = seed_tokens(logits, self.mask_id)
            hot = [r for r in seed_rows if states[r].params.temperature > 0]
            for r, z in dense_rows(logits, hot).items():
                probs = target_probs(z[:1], states[r].params.temperature, self.mask_id)
                seeds[r] = sample_inverse_cdf(probs, states[r].generator)[0]
        out = self._sampler.sample(states, logits)  # type: ignore[arg-type]
        if seeds is not None:
            if len(seed_rows) == len(states):
                out[:, 0] = seeds
            else:
                is_seed = to_device([s.phase != DENOISE for s in states], out.device)
                out[:, 0] = torch.where(is_seed, seeds.to(out.dtype), out[:, 0])
        return out

    def commit(
        self, states: Sequence[CausalBlockState], host: Sequence[Sequence[int]]
    ) -> list[StepResult]:
        return [self._commit_row(s, row) for s, row in zip(states, host, strict=True)]

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
            state.committed += 1
            return self._after_commit(state, 1, start_block=True)
        result = self._after_commit(state, commit_masked(state, row), start_block=False)
        if not result.finished and not state.masked:
            state.phase = REFRESH  # the block is final: its causal K/V come next
            state.schedule, state.step = [0], 0
        return result

    def _after_commit(
        self, state: CausalBlockState, committed: int, *, start_block: bool
    ) -> StepResult:
        result = finish_or_continue(state, committed)
        if not result.finished and start_block:
            self._start_block(state)
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
        schedule_block(state, state.params.steps)
