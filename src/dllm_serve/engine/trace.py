"""Per-step traces for the playground: what one forward did to one traced request.

Off the OpenAI path (the chat stream's ``delta.content`` stays append-only): a request
submitted with ``trace=True`` gets one event per forward in :attr:`RequestOutput.trace`,
which ``POST /v1/dllm/trace`` streams as server-sent events (docs/playground.md):

- denoising (LLaDA, Dream, block diffusion) — ``{"type": "step", "commits": [[position,
  token_id, text], ...], "masked": n, ...}``: the answer-canvas positions this step
  committed (position 0 is the first answer position) and how many are still masked;
- self-speculation (I-DLM ISD, LinearSpec) — ``{"type": "round", "drafts": [...], "accepted": j,
  "emitted": [...], ...}``: the drafts this round verified, how many were accepted and the
  tokens it emitted (accepted drafts plus the verifier's own token, except a stop token,
  which ends the answer and is not emitted).

Both carry ``nfe``, ``committed`` and ``tokens_per_forward`` so far. Tracing reads the
state's host lists only (no device access); its cost is a copy of the canvas per traced
step, so it is for watching a request, not for serving load.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Snapshot = tuple[Any, ...]


def snapshot(state: Any) -> Snapshot:
    """What :func:`step_event` compares against after the step (taken before the commit)."""
    if hasattr(state, "emitted"):  # self-speculation
        return ("round", list(state.specs), state.accepted_drafts, len(state.emitted))
    return ("step", state.tokens[state.prompt_len :])


def step_event(state: Any, before: Snapshot, piece: Callable[[int], str]) -> dict[str, Any]:
    """The trace event of the step that led from ``before`` to ``state``; ``piece`` is one
    token's text."""
    event: dict[str, Any] = {
        "type": before[0],
        "nfe": state.nfe,
        "committed": state.committed,
        "tokens_per_forward": round(state.tokens_per_forward, 3),
    }
    if before[0] == "round":
        _, drafts, accepted_before, emitted_before = before
        event |= {
            # The forward's number, as a diffusion step's: LinearSpec's first forward only
            # drafts, so counting verified rounds would repeat 0 (drafts and emitted empty).
            "round": state.nfe,
            "drafts": [piece(t) for t in drafts],
            "accepted": state.accepted_drafts - accepted_before,
            "emitted": [piece(t) for t in state.emitted[emitted_before:]],
        }
        return event
    _, old = before
    new = state.tokens[state.prompt_len :]
    mask_id = state.mask_id
    event |= {
        "step": state.nfe,
        "block": state.block,
        "commits": [
            [i, t, piece(t)] for i, (a, t) in enumerate(zip(old, new, strict=True)) if a != t
        ],
        "masked": sum(t == mask_id for t in new),
    }
    return event


def start_event(state: Any) -> dict[str, Any]:
    """The first event: the shape of what the following events fill in."""
    if hasattr(state, "emitted"):
        return {"type": "start", "mode": "self_speculation", "max_tokens": state.params.gen_length}
    return {
        "type": "start",
        "mode": "diffusion",
        "canvas": len(state.tokens) - state.prompt_len,
        "max_tokens": state.params.answer_budget,
        "block_length": getattr(state, "block_size", 0) or state.params.block_length,
        "steps": state.params.steps,
    }
