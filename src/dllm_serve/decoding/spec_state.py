"""What the two self-speculative states share: ISD's (``decoding/isd_state.py``) and
LinearSpec's (``decoding/linear_spec.py``).

Both emit verified tokens one by one into ``emitted`` and keep the same counters; they differ
in what a round forwards (``pending`` and strided drafts vs a draft/verify phase pair).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dllm_serve.decoding.params import DecodingParams
from dllm_serve.models.kv_pool import KVSpan

__all__ = ["SelfSpecState"]


@dataclass(slots=True, eq=False)
class SelfSpecState:
    """One self-speculative request (lives in the engine's Request); subclasses add their own
    round fields (keyword-only where they have no default, so they may follow these).

    - ``kv``: the request's KV-pool span; set by the engine at admission.
    - ``specs``: the drafts this round verifies.
    - ``emitted``: accepted answer tokens, stop id excluded; final as soon as they are here.

    Counters (usage/metrics): ``nfe`` forwards, ``rounds`` verified rounds, ``drafted`` specs
    verified, ``accepted_drafts`` specs accepted *and used* (a round's accepted specs after
    its stop id are not counted, so ``accepted_drafts <= committed``), ``committed`` tokens
    produced including a stop id. ``step`` mirrors ``rounds`` and ``block`` is always 0 so
    the engine's generic counters stay meaningful.
    """

    prompt_ids: list[int]
    params: DecodingParams
    generator: torch.Generator | None
    stop_ids: tuple[int, ...]
    kv: KVSpan | None = None
    specs: list[int] = field(default_factory=list)
    emitted: list[int] = field(default_factory=list)
    generated: int = 0  # tokens counted against max tokens (gen_length), stop id included
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
        """Tokens produced per forward (``committed / nfe``; 1 for AR)."""
        return self.committed / self.nfe if self.nfe else 0.0

    def answer_tokens(self) -> list[int]:
        """The accepted answer so far, stop id excluded (every token is final: stream it)."""
        return list(self.emitted)

    def emit(self, tokens: list[int]) -> int:
        """Append accepted tokens one by one, stopping at a stop id or at max tokens.

        Tokens after a stop are dropped even though they were accepted (verified) in the same
        round. Returns how many tokens were consumed (the stop id included).
        """
        consumed = 0
        for token in tokens:
            consumed += 1
            self.generated += 1
            self.committed += 1
            if token in self.stop_ids:
                self.finished, self.finish_reason = True, "stop"
                break
            self.emitted.append(token)
            if self.generated >= self.params.gen_length:
                self.finished, self.finish_reason = True, "length"
                break
        return consumed
