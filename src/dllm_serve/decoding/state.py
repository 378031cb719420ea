"""Per-request denoising state: the canvas, the position in the block loop, the counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dllm_serve.decoding.params import DecodingParams

if TYPE_CHECKING:
    from dllm_serve.models.kv_cache import KVCache


@dataclass(slots=True)
class DenoiseState:
    """Per-request denoising state (lives in the engine's Request).

    ``canvas`` is the 1-D LongTensor ``[P + G]`` on the model device: the prompt, then the
    answer region of ``G = params.gen_length`` positions that start as ``mask_id``. A position
    of the answer region is *committed* once it holds a token other than ``mask_id``; committed
    tokens never change. ``mask_id`` and ``stop_ids`` are copied from the denoiser so that the
    answer helpers below need nothing else.

    ``kv_cache`` is the request's block-level prefix cache (``decoding/prefix_cache.py``), or
    None without one (``--kv-cache none``) and once the request finished: the state is its only
    owner, so dropping the request frees it.

    Counters for usage and metrics: ``nfe`` (forward passes consumed) and ``committed``
    (canvas tokens committed); :attr:`tokens_per_forward` is their ratio.
    """

    canvas: torch.Tensor
    prompt_len: int
    params: DecodingParams
    generator: torch.Generator | None  # None when temperature == 0
    mask_id: int
    stop_ids: tuple[int, ...]
    block: int = 0  # index of the active block
    step: int = 0  # step index within the active block
    # Transfer counts of the active block in top-k mode; empty in the data-dependent modes.
    schedule: list[int] = field(default_factory=list)
    nfe: int = 0  # forward passes consumed
    committed: int = 0  # canvas tokens committed so far
    finished: bool = False
    finish_reason: str | None = None
    kv_cache: KVCache | None = None

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes held by the prefix cache (its buffer's capacity; 0 without one)."""
        cache = self.kv_cache  # read once: a metrics scrape may race the engine's release
        return cache.nbytes if cache is not None else 0

    @property
    def tokens_per_forward(self) -> float:
        """Canvas tokens committed per forward pass so far (``committed / nfe``; 0 before any).

        Counts every committed canvas token, including EOS/padding the answer later drops; 1.0
        is LLaDA's one-token-per-step regime, higher means parallel commits paid off.
        """
        return self.committed / self.nfe if self.nfe else 0.0

    @property
    def active_block(self) -> tuple[int, int]:
        """Canvas slice ``[lo, hi)`` of the active block."""
        assert self.params.block_length is not None  # resolved by DecodingParams
        lo = self.prompt_len + self.block * self.params.block_length
        return lo, lo + self.params.block_length

    def scan_answer(self) -> tuple[int, int | None]:
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
        return self.scan_answer()[0]

    def answer_tokens(self) -> list[int]:
        """The final answer so far: the contiguous committed prefix, cut before the first stop id.

        Everything returned is final (committed and contiguous from the start of the answer),
        so it is safe to stream. Stop ids are excluded.
        """
        final_len, first_stop = self.scan_answer()
        end = final_len if first_stop is None else first_stop
        return self.canvas[self.prompt_len : self.prompt_len + end].tolist()
