"""Structured output on a masked canvas (``response_format``; docs/structured-output.md): a
constrained row's first masked position is restricted to the tokens its grammar allows next
(:func:`mask_to_grammar`), greedy rows take their proposals from the most probable valid fill
of the block window (:func:`lookahead_fill`, :func:`beam_fill`; DiffusionGemma's projection
uses the same beam), and the host keeps only the valid left-to-right run of a row's commits
(:func:`grammar_run`), so the committed answer is always a prefix of a valid string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from dllm_serve.decoding.grammar import Constraint
from dllm_serve.decoding.protocol import StepLogits
from dllm_serve.decoding.sampler import restrict_to_bitmasks
from dllm_serve.models.attention import to_device


class ConstrainedRow(Protocol):
    """What this module reads of a row's state (``blocks.DenoiseState``)."""

    @property
    def constraint(self) -> Constraint | None: ...

    @property
    def stop_ids(self) -> Sequence[int]: ...


def mask_to_grammar(
    states: Sequence[ConstrainedRow], logits: StepLogits, rows: Sequence[int]
) -> StepLogits:
    """``logits`` with each of ``rows``' first requested position restricted to the tokens its
    grammar allows next (the others at −inf)."""
    masks = [states[r].constraint.allowed_bits() for r in rows]  # type: ignore[union-attr]
    return restrict_to_bitmasks(logits, [logits.offsets[r] for r in rows], masks)


# The lookahead's window (masked positions), beam width and candidates per beam and position.
LOOKAHEAD_DEPTH, LOOKAHEAD_BEAMS, LOOKAHEAD_CANDIDATES = 8, 4, 4
LOOKAHEAD_ALL_BELOW = 32  # a position allowing at most this many tokens weighs them all


def lookahead_fill(
    states: Sequence[ConstrainedRow], logits: StepLogits, rows: Sequence[int], mask_id: int
) -> list[list[int]]:
    """For each greedy constrained row in ``rows``: the most probable grammar-valid fill of
    its next ``D`` masked positions (a beam-searched DINGO MAP over the block window;
    docs/structured-output.md), as the tokens those positions propose.

    With ``log pⱼ`` the model's log-probabilities at the row's ``j``-th masked position (mask
    id excluded), a fill ``t₀ … t_m`` scores ``Σⱼ log pⱼ(tⱼ)``; every ``tⱼ`` must be allowed by
    the grammar after ``t₀ … tⱼ₋₁``, and a stop id (allowed only where the text is complete)
    ends the fill: the positions after it are padding and cost nothing. Fills are searched
    position by position, keeping the :data:`LOOKAHEAD_BEAMS` best prefixes and expanding
    each by its :data:`LOOKAHEAD_CANDIDATES` most probable allowed tokens (all of them where
    at most :data:`LOOKAHEAD_ALL_BELOW` are allowed: structure such as ``,`` ``}`` digits);
    a token after which the text is complete also scores the fill that ends with a stop id
    right after it, so an unlikely closing token competes through the end it enables. Scores
    only fall as a fill grows, so a prefix below the best finished fill is dropped.

    Why: plain masking takes ``argmax p₀``, and a model that wants to end (``p₁`` ≈ EOS) but
    may not yet keeps extending an open number or string until ``max_tokens``; the window
    sees that closing it (``}`` then EOS) beats ``D`` more digits. As in DINGO, the row's rule
    still picks which positions commit; the committed ones take the fill's tokens, so a valid
    run of several positions commits in one step. The fill is valid by construction, and the
    host's run check (:func:`grammar_run`) still guards every commit, so the guarantee is
    unchanged. One device→host copy of the window's log-probabilities for these rows (none
    on CPU).
    """
    if not rows:
        return []
    flat = logits.flat
    assert flat is not None
    device = flat.device
    depths = [min(LOOKAHEAD_DEPTH, logits.counts[r]) for r in rows]
    at = [logits.offsets[r] + j for r, d in zip(rows, depths, strict=True) for j in range(d)]
    z = flat.index_select(0, to_device(at, device, torch.long)).float()
    z[:, mask_id] = float("-inf")
    log_p = torch.log_softmax(z, dim=-1).cpu().numpy()
    chosen, start = [], 0
    for r, depth in zip(rows, depths, strict=True):
        state = states[r]
        assert state.constraint is not None
        chosen.append(beam_fill(state.constraint, log_p[start : start + depth], state.stop_ids))
        start += depth
    return chosen


def beam_fill(constraint: Constraint, log_p: np.ndarray, stop_ids: Sequence[int]) -> list[int]:
    """:func:`lookahead_fill` for one row (``log_p`` ``[D, V]``; DiffusionGemma's projection
    too, decoding/renoise.py): the best fill's tokens, at most ``D`` of them, ending with a
    stop id where the best fill ends the answer.

    A beam expands by its most probable allowed tokens and, where the grammar allows few
    tokens (structure: ``,``, ``}``, digits), by all of them; any token after which the text is
    complete also scores the fill that ends with a stop id at the next position, so a closing
    token the model finds unlikely still competes through the end it enables.
    """
    depth, vocab = log_p.shape
    stops = [t for t in stop_ids if t < vocab]
    done_score, done_fill = float("-inf"), None
    beams: list[tuple[float, tuple[int, ...], Constraint]] = [(0.0, (), constraint)]
    for j in range(depth):
        expansions: list[tuple[float, tuple[int, ...], Constraint]] = []
        for score, fill, matcher in beams:
            bits = np.frombuffer(matcher.allowed_bits(), dtype=np.uint8)
            allowed = np.flatnonzero(np.unpackbits(bits, bitorder="little")[:vocab])
            row = log_p[j, allowed]
            if allowed.size > LOOKAHEAD_ALL_BELOW:
                top = np.argsort(-row, kind="stable")[:LOOKAHEAD_CANDIDATES]
                allowed, row = allowed[top], row[top]
            for token, lp in zip(allowed.tolist(), row.tolist(), strict=True):
                total = score + lp
                if token in stops or total <= done_score:
                    if token in stops and total > done_score:
                        done_score, done_fill = total, (*fill, token)
                    continue
                if j + 1 < depth and matcher.completes_with(token):
                    stop = stops[int(np.argmax(log_p[j + 1, stops]))]
                    ended = total + float(log_p[j + 1, stop])
                    if ended > done_score:
                        done_score, done_fill = ended, (*fill, token, stop)
                expansions.append((total, (*fill, token), matcher))
        expansions.sort(key=lambda e: -e[0])
        kept = [e for e in expansions[:LOOKAHEAD_BEAMS] if e[0] > done_score]
        if not kept or j == depth - 1:
            # Scores only fall as a fill grows: an open fill at the window's end competes
            # with the best ended one as it stands.
            if kept and kept[0][0] > done_score:
                return list(kept[0][1])
            break
        beams = []
        for total, fill, matcher in kept:
            twin = matcher.fork()
            twin.accept([fill[-1]])
            beams.append((total, fill, twin))
    if done_fill is not None:
        return list(done_fill)
    # Nothing scored above -inf (cannot happen: the first position has an allowed token).
    bits = np.frombuffer(constraint.allowed_bits(), dtype=np.uint8)
    allowed = np.flatnonzero(np.unpackbits(bits, bitorder="little")[:vocab])
    return [int(allowed[np.argmax(log_p[0, allowed])])]


def grammar_run(state: ConstrainedRow, row: Sequence[int], mask_id: int) -> list[int]:
    """A constrained row's commits cut to what its grammar accepts: the run of committed
    tokens from the first masked position (contiguous: a constrained row's masks are always
    the tail of its block), up to the first token that could not continue to a valid string.
    The matcher consumes the kept tokens; everything else stays masked for later steps."""
    assert state.constraint is not None
    run: list[int] = []
    for token in row:
        if token == mask_id:
            break
        run.append(token)
    kept = state.constraint.accept(run)
    if not kept:
        # The first position was proposed under the grammar's mask, so this is a bug; never
        # commit text the grammar rejects.
        raise RuntimeError("structured output: the grammar rejected the masked proposal")
    return run[:kept] + [mask_id] * (len(row) - kept)
