"""The contract between a decoding algorithm, the engine and the model for one forward."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch


class AttentionKind(StrEnum):
    BIDIRECTIONAL = "bidirectional"
    CAUSAL = "causal"


@dataclass(slots=True)
class ForwardSpec:
    """What one row needs from one model forward.

    ``input_ids`` and ``positions`` are 1-D (length L) on the model's device. ``logits_index``
    lists the positions (0..L-1) whose logits the algorithm needs; the LM head is applied only
    there, because a full-vocabulary head over the whole canvas dominates the step time.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    logits_index: torch.Tensor
    attention: AttentionKind = AttentionKind.BIDIRECTIONAL


@dataclass(slots=True)
class StepResult:
    """What one algorithm update did to its request."""

    committed: int  # tokens committed this step
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" when finished
