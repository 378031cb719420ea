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
    # The widest stride a round may use (the largest tier's): the stride itself follows the
    # engine's load, so the scheduler budgets the widest row the next round can be.
    max_stride: int = field(default=1, kw_only=True)

    @property
    def is_prefill(self) -> bool:
        """The first round carries the whole prompt (fused with the first cold start)."""
        return self.rounds == 0

    @property
    def row_length(self) -> int:
        """At most the tokens this request's next row puts in a forward: ``pending``, the specs
        a stride of N verifies (at most N − 1) and N − 1 masks, at the widest N that is left
        (exact without tiers, whose stride is the widest)."""
        n = max(1, min(self.max_stride, self.params.gen_length - self.generated))
        return len(self.pending) + min(len(self.specs), n - 1) + n - 1
