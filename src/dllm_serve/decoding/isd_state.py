"""Per-request state of introspective strided decoding (see ``decoding/isd.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dllm_serve.decoding.params import DecodingParams
from dllm_serve.models.kv_pool import KVSpan


@dataclass(slots=True, eq=False)
class ISDState:
    """One request's ISD state (lives in the engine's Request).

    - ``kv``: the request's KV-pool span; its ``length`` covers exactly the causal K/V of
      ``prompt + emitted[:-1]`` (accepted tokens only). Set by the engine at admission.
    - ``pending``: tokens whose KV is not cached yet: the prompt before the first round, then
      the last emitted token.
    - ``specs``: drafts for the slots after ``pending``; ``draft_q`` ``[K, V]`` float64 holds
      the distributions they were sampled from (None at T = 0, where drafts are argmaxes).
    - ``emitted``: accepted answer tokens, stop id excluded; final as soon as they are here.

    Counters (usage/metrics): ``nfe`` forwards, ``rounds`` (== nfe: one forward per round),
    ``drafted`` specs verified, ``accepted_drafts`` specs accepted, ``committed`` tokens
    produced including a stop id. ``step`` mirrors ``rounds`` and ``block`` is always 0 so the
    engine's generic counters stay meaningful.
    """

    prompt_ids: list[int]
    params: DecodingParams
    generator: torch.Generator | None
    stop_ids: tuple[int, ...]
    pending: list[int]
    device: torch.device
    kv: KVSpan | None = None
    specs: list[int] = field(default_factory=list)
    draft_q: torch.Tensor | None = None
    next_q: torch.Tensor | None = None  # this round's draft distributions, kept if all accepted
    emitted: list[int] = field(default_factory=list)
    generated: int = 0  # tokens counted against max tokens (gen_length), stop id included
    round_shape: tuple[int, int] = (0, 1)  # (K specs, N stride) of the prepared round
    nfe: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted_drafts: int = 0
    committed: int = 0
    block: int = 0
    finished: bool = False
    finish_reason: str | None = None

    @property
    def step(self) -> int:
        return self.rounds

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def tokens_per_forward(self) -> float:
        """Tokens produced per forward (``committed / nfe``; N at full acceptance, 1 for AR)."""
        return self.committed / self.nfe if self.nfe else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted specs / verified specs (0 before any spec was verified)."""
        return self.accepted_drafts / self.drafted if self.drafted else 0.0

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

    def answer_tokens(self) -> list[int]:
        """The accepted answer so far, stop id excluded (every token is final: stream it)."""
        return list(self.emitted)
