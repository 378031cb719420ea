"""LLaDA-style block denoising: the per-step loop shared by every commit rule."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dllm_serve.decoding.commit import threshold_commit, topk_commit
from dllm_serve.decoding.confidence import confidence as confidence_of
from dllm_serve.decoding.forward_spec import AttentionKind, ForwardSpec, StepResult
from dllm_serve.decoding.local_leap import local_leap_commit
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.decoding.prefix_cache import (
    KVCacheFactory,
    max_prefix_length,
    prefix_spec,
    release,
    reset_for_block,
)
from dllm_serve.decoding.sampling import gumbel_argmax
from dllm_serve.decoding.schedules import block_schedule
from dllm_serve.decoding.state import DenoiseState

__all__ = ["DenoiseState", "LLaDADenoiser"]

_SEED_MODULUS = 2**64  # torch.Generator seeds are unsigned 64-bit


class LLaDADenoiser:
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
    - ``threshold`` (Fast-dLLM) and ``local_leap``: see ``decoding/commit.py`` and
      ``decoding/local_leap.py``; each step commits at least one token, so a block takes
      between 1 and ``block_length`` forwards.

    Family rules: with ``logit_shift`` (Dream, I-DLM) the logits that predict position ``j``
    come from position ``j − 1``, so :meth:`prepare` asks for ``masked − 1`` while the commit
    still writes ``j``; with ``bidirectional=False`` the forward uses causal attention.

    Prefix KV cache (``kv_cache_factory`` set; ``decoding/prefix_cache.py``): the first step
    of each block is the full forward above and also stores the committed prefix's keys and
    values; the block's other steps forward only the canvas from the block on, attending to
    that (slightly stale) prefix. Commit rules, schedules and the early stop are unchanged:
    only the logits differ (Fast-dLLM's approximation).

    The denoiser holds only configuration; all mutable state lives in ``DenoiseState`` and
    the randomness comes from the state's own generator, so interleaving requests step by
    step — whatever their parameters — gives the same result as running each alone.
    """

    def __init__(
        self,
        mask_id: int,
        stop_ids: Sequence[int],
        *,
        logit_shift: bool = False,
        bidirectional: bool = True,
        kv_cache_factory: KVCacheFactory | None = None,
    ) -> None:
        if mask_id in stop_ids:
            raise ValueError("the mask id cannot be a stop id")
        self.mask_id = mask_id
        self.stop_ids = tuple(stop_ids)
        self.logit_shift = logit_shift
        self.attention = AttentionKind.BIDIRECTIONAL if bidirectional else AttentionKind.CAUSAL
        self.kv_cache_factory = kv_cache_factory
        self._shift = 1 if logit_shift else 0

    def init_state(
        self, prompt_ids: Sequence[int], params: DecodingParams, device: torch.device | str
    ) -> DenoiseState:
        """Build the canvas ``[prompt ; mask × gen_length]`` and the request's generator."""
        prompt = torch.as_tensor(list(prompt_ids), dtype=torch.long)
        if self.mask_id in params.stop_token_ids:
            raise ValueError("the mask id cannot be a stop id")
        if self.logit_shift and prompt.numel() == 0:
            # The first answer position is predicted from the last prompt position.
            raise ValueError("a model with shifted logits needs a non-empty prompt")
        canvas = torch.full(
            (prompt.numel() + params.gen_length,), self.mask_id, dtype=torch.long, device=device
        )
        canvas[: prompt.numel()] = prompt.to(canvas.device)
        generator = None
        if params.temperature > 0:
            generator = torch.Generator(device=canvas.device)
            if params.seed is None:
                generator.seed()  # fresh nondeterministic seed, as torch.seed() does
            else:
                # Any int64 (negative too) maps onto the generator's unsigned 64-bit seed space.
                generator.manual_seed(params.seed % _SEED_MODULUS)
        state = DenoiseState(
            canvas=canvas,
            prompt_len=prompt.numel(),
            params=params,
            generator=generator,
            mask_id=self.mask_id,
            stop_ids=() if params.ignore_eos else (*self.stop_ids, *params.stop_token_ids),
        )
        if self.kv_cache_factory is not None:
            assert params.block_length is not None  # resolved by DecodingParams
            # Reserve the last block's prefix now: the buffer never grows (no copies), and
            # the request's peak cache memory is visible from admission on.
            state.kv_cache = self.kv_cache_factory(
                max_prefix_length(
                    state.prompt_len, params.gen_length, params.block_length, self._shift
                )
            )
        self._start_block(state)
        return state

    def prepare(self, state: DenoiseState) -> ForwardSpec:
        """The whole canvas; logits only for the active block's masks.

        With a prefix cache, the canvas from the cached prefix's end instead (except on a
        block's first step). ``input_ids`` aliases ``state.canvas`` (no copy): the forward
        must run before ``update`` mutates it.
        """
        if state.finished:
            raise RuntimeError("prepare() called on a finished request")
        index = self._active_masked(state)
        if state.kv_cache is not None:
            return prefix_spec(state, index, self._shift, self.attention)
        return ForwardSpec(
            input_ids=state.canvas,
            positions=torch.arange(state.canvas.numel(), device=state.canvas.device),
            # Shifted families predict position j at j − 1; j − 1 ≥ prompt_len − 1 ≥ 0.
            logits_index=index - 1 if self.logit_shift else index,
            attention=self.attention,
        )

    def update(self, state: DenoiseState, logits: torch.Tensor) -> StepResult:
        """Commit proposals from ``logits`` ``[len(logits_index), V]`` (row i → masked i)."""
        if state.finished:
            raise RuntimeError("update() called on a finished request")
        index = self._active_masked(state)
        if logits.dim() != 2 or logits.shape[0] != index.numel():
            raise ValueError(
                f"expected logits [{index.numel()}, V] for the positions prepare() returned, "
                f"got {tuple(logits.shape)}"
            )
        params = state.params
        # Top-k: this step's schedule entry. The schedule sums to the block's mask count and
        # each step commits exactly its entry, so the masks left always cover it. Other modes:
        # None, data-dependent (the block still has masks, so at least one commits).
        k = state.schedule[state.step] if params.mode == "topk" else None
        assert k is None or k <= index.numel(), "schedule out of sync with the canvas"
        committed = 0
        if k != 0:  # a zero-commit step draws no noise, so the generator stays in step
            x0, score = self._propose(state, logits)
            commit = self._commit_rule(params, score, index, k)
            state.canvas[index[commit]] = x0[commit]
            committed = int(commit.sum()) if k is None else k
        state.committed += committed
        state.nfe += 1
        state.step += 1

        final_len, first_stop = state.scan_answer()
        if first_stop is not None:
            # Exact early stop: the answer is the canvas cut before its first stop id. Every
            # position up to and including that stop id is committed, and committed tokens
            # never change, so no later step can alter the answer; decoding the rest of the
            # canvas would only fill positions that are discarded anyway.
            return self._finish(state, committed, "stop")
        if final_len == params.gen_length:
            # Everything is committed and no stop id appeared. Trailing zero-commit steps of
            # the last block (steps_per_block > block_length) would change nothing: skip them.
            return self._finish(state, committed, "length")
        block_done = (
            state.step == len(state.schedule)
            if params.mode == "topk"
            else committed == index.numel()
        )
        if block_done:
            state.block += 1
            state.step = 0
            self._start_block(state)
        return StepResult(committed=committed, finished=False)

    def _propose(
        self, state: DenoiseState, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Proposals ``x0`` and their confidences for the rows of ``logits``."""
        z = logits.to(torch.float64, copy=True)
        # The mask id is a real vocabulary entry; proposing it would "commit" a mask and
        # break the count (dInfer guards the same way). Excluding it here also removes it
        # from the distribution the confidence is computed under.
        z[:, self.mask_id] = float("-inf")
        x0 = gumbel_argmax(z, state.params.temperature, state.generator)
        return x0, confidence_of(state.params.confidence_metric, z, x0)

    @staticmethod
    def _commit_rule(
        params: DecodingParams, score: torch.Tensor, index: torch.Tensor, k: int | None
    ) -> torch.Tensor:
        """Boolean mask over the masked positions ``index``: which proposals to commit."""
        if k is not None:
            return topk_commit(score, k)
        if params.mode == "threshold":
            assert params.confidence_threshold is not None  # implied by the mode
            return threshold_commit(score, params.confidence_threshold)
        return local_leap_commit(
            score,
            index,
            params.local_leap_anchor_threshold,
            params.local_leap_neighbor_threshold,
            params.local_leap_radius,
        )

    def _start_block(self, state: DenoiseState) -> None:
        """Empty the prefix cache (refreshed by the block's first forward) and compute the
        active block's schedule (top-k mode only) from its masked count."""
        reset_for_block(state)
        if state.params.mode != "topk":
            state.schedule = []
            return
        lo, hi = state.active_block
        num_masked = int((state.canvas[lo:hi] == self.mask_id).sum())
        state.schedule = block_schedule(
            state.params.block_schedule, num_masked, state.params.steps_per_block
        )

    def _active_masked(self, state: DenoiseState) -> torch.Tensor:
        """Ascending canvas positions of the active block that are still masked."""
        lo, hi = state.active_block
        return torch.nonzero(state.canvas[lo:hi] == self.mask_id).squeeze(1) + lo

    @staticmethod
    def _finish(state: DenoiseState, committed: int, reason: str) -> StepResult:
        state.finished = True
        state.finish_reason = reason
        release(state)  # free the cache now, not when the engine drops the request
        return StepResult(committed=committed, finished=True, finish_reason=reason)
