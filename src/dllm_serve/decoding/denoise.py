"""LLaDA block denoising: per-request state and the top-k low-confidence commit rule."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dllm_serve.decoding.confidence import top1_prob
from dllm_serve.decoding.forward_spec import AttentionKind, ForwardSpec, StepResult
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.decoding.sampling import gumbel_argmax
from dllm_serve.decoding.schedules import block_schedule

_SEED_MODULUS = 2**64  # torch.Generator seeds are unsigned 64-bit


@dataclass(slots=True)
class DenoiseState:
    """Per-request denoising state (lives in the engine's Request).

    ``canvas`` is the 1-D LongTensor ``[P + G]`` on the model device: the prompt, then the
    answer region of ``G = params.gen_length`` positions that start as ``mask_id``. A position
    of the answer region is *committed* once it holds a token other than ``mask_id``; committed
    tokens never change. ``mask_id`` and ``stop_ids`` are copied from the denoiser so that the
    answer helpers below need nothing else.
    """

    canvas: torch.Tensor
    prompt_len: int
    params: DecodingParams
    generator: torch.Generator | None  # None when temperature == 0
    mask_id: int
    stop_ids: tuple[int, ...]
    block: int = 0  # index of the active block
    step: int = 0  # step index within the active block
    schedule: list[int] = field(default_factory=list)  # transfer counts of the active block
    nfe: int = 0  # forward passes consumed
    committed: int = 0  # canvas tokens committed so far
    finished: bool = False
    finish_reason: str | None = None

    @property
    def active_block(self) -> tuple[int, int]:
        """Canvas slice ``[lo, hi)`` of the active block."""
        lo = self.prompt_len + self.block * self.params.block_length
        return lo, lo + self.params.block_length

    def _scan_answer(self) -> tuple[int, int | None]:
        """(length of the contiguous committed answer prefix, first stop index in it or None).

        One device→host transfer: both reductions are computed on the canvas's device.
        """
        answer = self.canvas[self.prompt_len :]
        g = answer.numel()
        pos = torch.arange(g, device=answer.device)
        sentinel = torch.full_like(pos, g)
        final_len = torch.where(answer == self.mask_id, pos, sentinel).min()
        is_stop = torch.zeros_like(answer, dtype=torch.bool)
        for stop_id in self.stop_ids:
            is_stop |= answer == stop_id
        first_stop = torch.where(is_stop & (pos < final_len), pos, sentinel).min()
        final, stop = torch.stack([final_len, first_stop]).tolist()
        return final, (stop if stop < g else None)

    def answer_final_len(self) -> int:
        """Length of the contiguous committed prefix of the answer (stops at the first mask)."""
        return self._scan_answer()[0]

    def answer_tokens(self) -> list[int]:
        """The final answer so far: the contiguous committed prefix, cut before the first stop id.

        Everything returned is final (committed and contiguous from the start of the answer),
        so it is safe to stream. Stop ids are excluded.
        """
        final_len, first_stop = self._scan_answer()
        end = final_len if first_stop is None else first_stop
        return self.canvas[self.prompt_len : self.prompt_len + end].tolist()


class LLaDADenoiser:
    """LLaDA semi-autoregressive sampling with low-confidence remasking (top-k commit).

    The answer region of ``G`` masks is split into ``G / block_length`` blocks decoded left to
    right; each block gets ``steps_per_block`` steps and a schedule ``k_0..k_{s-1}`` (how many
    of its masks to commit per step, summing to the block's mask count). At every step the
    model sees the whole canvas with bidirectional attention; for each still-masked position
    of the active block we propose ``x0`` (argmax at T = 0, else a Gumbel-max sample from
    ``softmax(z / T)``) and score it by its untempered probability ``softmax(z)[x0]``. The
    ``k_i`` most confident proposals are committed; the rest stay masked ("remasked") and are
    predicted again next step with more context. This is exactly the reference
    ``generate()`` (ML-GSAI/LLaDA) restricted to the positions it could commit, since it sets
    the confidence of everything outside the active block's masks to ``-inf``.

    The denoiser holds only configuration; all mutable state lives in ``DenoiseState``, and the
    randomness comes from the state's own generator, so interleaving requests step by step
    gives the same result as running each alone.
    """

    def __init__(self, mask_id: int, stop_ids: Sequence[int]) -> None:
        if mask_id in stop_ids:
            raise ValueError("the mask id cannot be a stop id")
        self.mask_id = mask_id
        self.stop_ids = tuple(stop_ids)

    def init_state(
        self, prompt_ids: Sequence[int], params: DecodingParams, device: torch.device | str
    ) -> DenoiseState:
        """Build the canvas ``[prompt ; mask × gen_length]`` and the request's generator."""
        if params.confidence_metric != "top1_prob":
            raise ValueError(f"confidence_metric {params.confidence_metric!r} is not available yet")
        prompt = torch.as_tensor(list(prompt_ids), dtype=torch.long)
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
            stop_ids=self.stop_ids,
        )
        self._start_block(state)
        return state

    def prepare(self, state: DenoiseState) -> ForwardSpec:
        """The whole canvas, bidirectional; logits only at the active block's masks.

        ``input_ids`` aliases ``state.canvas`` (no copy): the forward must run before
        ``update`` mutates it.
        """
        if state.finished:
            raise RuntimeError("prepare() called on a finished request")
        return ForwardSpec(
            input_ids=state.canvas,
            positions=torch.arange(state.canvas.numel(), device=state.canvas.device),
            logits_index=self._active_masked(state),
            attention=AttentionKind.BIDIRECTIONAL,
        )

    def update(self, state: DenoiseState, logits: torch.Tensor) -> StepResult:
        """Commit ``schedule[step]`` tokens from ``logits`` ``[len(logits_index), V]``."""
        if state.finished:
            raise RuntimeError("update() called on a finished request")
        index = self._active_masked(state)
        if logits.dim() != 2 or logits.shape[0] != index.numel():
            raise ValueError(
                f"expected logits [{index.numel()}, V] for the positions prepare() returned, "
                f"got {tuple(logits.shape)}"
            )
        k = state.schedule[state.step]
        # The schedule sums to the block's mask count and each step commits exactly its
        # entry, so the masks left always cover this step's count.
        assert k <= index.numel(), "schedule out of sync with the canvas"
        if k > 0:
            z = logits.to(torch.float64, copy=True)
            # The mask id is a real vocabulary entry; proposing it would "commit" a mask and
            # break the count (dInfer guards the same way). Excluding it here also removes it
            # from the distribution the confidence is computed under.
            z[:, self.mask_id] = float("-inf")
            x0 = gumbel_argmax(z, state.params.temperature, state.generator)
            confidence = top1_prob(z, x0)
            # Stable descending sort over ascending positions: equal confidences are broken
            # by the lowest position, deterministically (torch.topk gives no such promise).
            chosen = torch.sort(confidence, descending=True, stable=True).indices[:k]
            state.canvas[index[chosen]] = x0[chosen]
        state.committed += k
        state.nfe += 1
        state.step += 1

        final_len, first_stop = state._scan_answer()
        if first_stop is not None:
            # Exact early stop: the answer is the canvas cut before its first stop id. Every
            # position up to and including that stop id is committed, and committed tokens
            # never change, so no later step can alter the answer; decoding the rest of the
            # canvas would only fill positions that are discarded anyway.
            return self._finish(state, k, "stop")
        if final_len == state.params.gen_length:
            # Everything is committed and no stop id appeared. Trailing zero-commit steps of
            # the last block (steps_per_block > block_length) would change nothing: skip them.
            return self._finish(state, k, "length")
        if state.step == len(state.schedule):
            state.block += 1
            state.step = 0
            self._start_block(state)
        return StepResult(committed=k, finished=False)

    def _start_block(self, state: DenoiseState) -> None:
        """Compute the active block's schedule from its masked count."""
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
        return StepResult(committed=committed, finished=True, finish_reason=reason)
