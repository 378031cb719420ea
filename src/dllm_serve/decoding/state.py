"""Per-request denoising state: the canvas (on the host), the block loop, the counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dllm_serve.decoding.params import DecodingParams

if TYPE_CHECKING:
    from dllm_serve.models.kv_pool import KVSpan


@dataclass(slots=True, eq=False)
class DenoiseState:
    """Per-request denoising state (lives in the engine's Request).

    ``tokens`` is the canvas as a host list ``[P + G]``: the prompt, then the answer region
    of ``G = params.gen_length`` positions that start as ``mask_id``. A position of the answer
    region is *committed* once it holds a token other than ``mask_id``; committed tokens never
    change. The host copy is what makes a step cheap: which positions are masked, the block's
    schedule and the contiguous final prefix are known without reading the device, and the
    one device→host copy per step brings back only the tokens committed in it.

    ``kv`` is the request's span in the KV pool when the prefix cache is on
    (``decoding/prefix_cache.py``), None without one; ``kv.length`` is the cached prefix.

    Counters for usage and metrics: ``nfe`` (forward passes consumed) and ``committed``
    (canvas tokens committed); :attr:`tokens_per_forward` is their ratio.
    """

    tokens: list[int]
    prompt_len: int
    params: DecodingParams
    generator: torch.Generator | None  # None when temperature == 0
    mask_id: int
    stop_ids: tuple[int, ...]
    block: int = 0  # index of the active block
    step: int = 0  # step index within the active block
    # Transfer counts of the active block in top-k mode; empty in the data-dependent modes.
    schedule: list[int] = field(default_factory=list)
    masked: list[int] = field(default_factory=list)  # active block's masked positions, ascending
    nfe: int = 0  # forward passes consumed
    committed: int = 0  # canvas tokens committed so far
    final_len: int = 0  # contiguous committed answer prefix
    stop_at: int | None = None  # answer index of the first stop id in that prefix
    finished: bool = False
    finish_reason: str | None = None
    kv: KVSpan | None = None
    drafted: int | None = None  # self-speculation counters (not used by diffusion decoding)
    accepted_drafts: int | None = None
    # Masked positions past the active block that a forward includes (None: the whole canvas,
    # the reference loop). A model trained on short canvases sets it (generation_config.json
    # ``mask_lookahead``) so that a long canvas is seen block by block as a short one is.
    mask_lookahead: int | None = None

    @property
    def canvas(self) -> torch.Tensor:
        """The canvas as a 1-D LongTensor (a copy, for inspection and tests)."""
        return torch.tensor(self.tokens, dtype=torch.long)

    @property
    def is_prefill(self) -> bool:
        """Every denoising step forwards the canvas (prompt included): one phase, no prefill."""
        return False

    @property
    def visible_end(self) -> int:
        """End of the canvas the next forward includes: everything, or with a mask lookahead
        the active block and at most ``mask_lookahead`` masks after it. Later positions are
        all still masked (blocks commit left to right), so leaving them out only removes MASK
        keys that the active block would otherwise attend to."""
        if self.mask_lookahead is None:
            return len(self.tokens)
        return min(len(self.tokens), self.active_block[1] + self.mask_lookahead)

    @property
    def row_length(self) -> int:
        """Tokens this request puts in its next forward (the scheduler's token budget)."""
        if self.kv is not None and self.kv.length:
            return self.visible_end - self.kv.length
        return self.visible_end

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

    def advance_final(self) -> int:
        """Extend the contiguous committed prefix after commits; returns how far it moved.

        Every block before the active one is complete, so the scan starts where it stopped;
        the first stop id inside the final prefix is remembered (committed tokens never change,
        so it is final too).
        """
        # The answer region: a canvas may hold more (rounded up to whole blocks), never less.
        budget = self.params.answer_budget
        start = self.final_len
        end = start
        base = self.prompt_len
        tokens, mask_id = self.tokens, self.mask_id
        while end < budget and tokens[base + end] != mask_id:
            if self.stop_at is None and tokens[base + end] in self.stop_ids:
                self.stop_at = end
            end += 1
        self.final_len = end
        return end - start

    def answer_tokens(self) -> list[int]:
        """The final answer so far: the contiguous committed prefix, cut before the first stop id.

        Everything returned is final (committed and contiguous from the start of the answer),
        so it is safe to stream. Stop ids are excluded.
        """
        end = self.final_len if self.stop_at is None else self.stop_at
        return self.tokens[self.prompt_len : self.prompt_len + end]
