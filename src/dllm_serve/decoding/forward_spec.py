"""The contract between a decoding algorithm, the engine's ModelRunner and the model.

An algorithm describes each row of a forward as a :class:`RowSpec` (host data only: token ids,
where the row starts, which outputs it needs, its attention kind and its KV span); the
ModelRunner packs the rows of a step into one flat batch, runs the model and returns the
logits as ``[rows, M, V]`` (row ``r``'s ``len(logits_at)`` entries first, padding after).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from dllm_serve.models.kv_pool import KVSpan


class AttentionKind(StrEnum):
    BIDIRECTIONAL = "bidirectional"
    CAUSAL = "causal"
    # Bidirectional inside blocks of ``RowSpec.block`` tokens aligned to position 0, causal
    # across them (block diffusion's prefill of whole prompt blocks).
    BLOCK_CAUSAL = "block_causal"


@dataclass(slots=True)
class RowSpec:
    """What one row needs from one model forward.

    ``tokens`` are the row's query tokens, at rotary positions ``start, start + 1, …``.
    ``logits_at`` lists offsets into ``tokens`` whose logits the algorithm needs (the LM head
    runs only there: a full-vocabulary head over the whole canvas dominates the step time).

    KV: with ``kv`` (the request's span in the KV pool) the row's queries also attend to the
    span's cached prefix, positions ``[0, start)`` — so ``start`` must equal what the span
    holds — and the K/V of all ``tokens`` are written to their slots; the algorithm then says
    how many of them the request keeps (``KVSpan.length``). Without ``kv`` the row attends to
    its own tokens only. ``attention`` applies among the current tokens and towards the prefix:
    CAUSAL sees every earlier position, BIDIRECTIONAL sees all of them.

    ``draft``: the row is computed in the draft weight view (``models/lora.py``).
    """

    tokens: list[int]
    start: int
    logits_at: list[int]
    attention: AttentionKind = AttentionKind.BIDIRECTIONAL
    kv: KVSpan | None = None
    block: int = 0  # the block size of BLOCK_CAUSAL attention
    # The draft weight view (a tri-mode model's draft-only LoRA applies to this row's tokens);
    # False: base weights. A property of the phase, never of the request.
    draft: bool = False

    @property
    def causal(self) -> bool:
        return self.attention is AttentionKind.CAUSAL

    def check(self) -> None:
        """A row must forward tokens and ask for at least one position's logits."""
        if not self.tokens or not self.logits_at:
            raise ValueError("a row needs tokens and at least one requested output")

    # Tensor views for tests and simple callers (the runner packs the host lists directly).
    @property
    def input_ids(self) -> torch.Tensor:
        return torch.tensor(self.tokens, dtype=torch.long)

    @property
    def positions(self) -> torch.Tensor:
        return torch.arange(self.start, self.start + len(self.tokens))

    @property
    def logits_index(self) -> torch.Tensor:
        return torch.tensor(self.logits_at, dtype=torch.long)


@dataclass(slots=True)
class StepResult:
    """What one step did to one request."""

    committed: int  # tokens committed this step
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" when finished
    new_tokens: int = 0  # answer tokens that became final (streamable) this step
