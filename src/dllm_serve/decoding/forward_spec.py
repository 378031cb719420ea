"""The contract between a decoding algorithm, the engine and the model for one forward."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from dllm_serve.models.kv_cache import KVCache


class AttentionKind(StrEnum):
    BIDIRECTIONAL = "bidirectional"
    CAUSAL = "causal"


@dataclass(slots=True)
class ForwardSpec:
    """What one row needs from one model forward.

    ``input_ids`` and ``positions`` are 1-D (length L) on the model's device. ``logits_index``
    lists the positions (0..L-1) whose logits the algorithm needs; the LM head is applied only
    there, because a full-vocabulary head over the whole canvas dominates the step time.

    KV: with ``kv_cache`` set, every query of this row also attends to the cache's prefix
    (positions ``[0, kv_cache.length)``, so ``positions`` should continue from there), and the
    K/V of the first ``kv_write`` tokens of ``input_ids`` are appended to the cache after the
    forward succeeds. ``attention`` applies to the current tokens: CAUSAL adds a lower-
    triangular mask among them; BIDIRECTIONAL lets them all see each other (with a cache, that
    is "bidirectional inside the block + attend to a cached prefix").
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    logits_index: torch.Tensor
    attention: AttentionKind = AttentionKind.BIDIRECTIONAL
    kv_cache: KVCache | None = None
    kv_write: int = 0


@dataclass(slots=True)
class StepResult:
    """What one algorithm update did to its request."""

    committed: int  # tokens committed this step
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" when finished
