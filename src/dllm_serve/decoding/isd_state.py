"""Per-request state of introspective strided decoding (see ``decoding/isd.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dllm_serve.decoding.spec_state import SelfSpecState


@dataclass(slots=True, eq=False)
class ISDState(SelfSpecState):
    """One request's ISD state (lives in the engine's Request); the shared fields, counters and
    :meth:`~SelfSpecState.emit` are :class:`SelfSpecState`'s.

    - ``kv``: its ``length`` covers exactly the causal K/V of ``prompt + emitted[:-1]``
      (accepted tokens only).
    - ``pending``: tokens whose KV is not cached yet: the prompt before the first round, then
      the last emitted token.
    - ``specs``: drafts for the slots after ``pending``; ``draft_q`` ``[K, V]`` float64 holds
      the distributions they were sampled from (None at T = 0, where drafts are argmaxes).

    ``rounds`` == ``nfe``: one forward per round.
    """

    pending: list[int] = field(kw_only=True)
    device: torch.device = field(kw_only=True)
    draft_q: torch.Tensor | None = None
    next_q: torch.Tensor | None = None  # this round's draft distributions, kept if all accepted
    round_shape: tuple[int, int] = (0, 1)  # (K specs, N stride) of the prepared round

    @property
    def accepted_per_round(self) -> float:
        """Mean accepted drafts per round."""
        return self.accepted_drafts / self.rounds if self.rounds else 0.0

    @property
    def is_prefill(self) -> bool:
        """The first round carries the whole prompt (fused with the first cold start)."""
        return self.rounds == 0

    @property
    def row_length(self) -> int:
        """Tokens this request's next row puts in a forward (at most ``len(pending)`` + 2N−2)."""
        return len(self.pending) + len(self.specs) + self.round_shape[1] - 1
