"""Log-probabilities of answer tokens (``logprobs`` / ``top_logprobs``).

An autoregressive engine reports, for each answer token, its log-probability under the
distribution it was sampled from. Here each token has one forward that decided it, and its
logprob is taken from that forward's logits at its position: the log-softmax over the
vocabulary with the mask id excluded (the distribution proposals and verifications use), at
temperature 1, and the ``k`` most likely tokens there as the alternatives.

- **Masked diffusion** (canvas denoising, block diffusion, token editing): the forward of the
  step that *committed* the token; a token written again later (editing) takes the logprob
  of the forward that wrote it last.
- **Self-speculation** (I-DLM's ISD, a tri-mode model's ``ar`` and ``linear_spec``): the
  verify forward that emitted it, at the row that predicts it — an accepted draft's entry is
  the draft's own, the round's last token (the verifier's correction or bonus) is the token
  the verifier chose.

It costs nothing on the step's one device→host copy. Before the batched sampler consumes the
logits, the log-softmax of each asking row's requested rows is taken (a copy); after it, the
entries of whatever the step committed (or, for self-speculation, of every candidate: the
drafts and each row's own token) are written on the device; a self-speculative round's
emitted tokens pick theirs when the host commit knows how many were accepted. The host reads
a request's entries only when its tokens become final (one small copy in those steps, for
those requests only).

Not recorded: the seeded block decoders (Fast-dLLM v2, a tri-mode model's ``diffusion``),
which place a seed token beside the committed ones, and DiffusionGemma's renoise canvases
(the registry's ``supports_logprobs``; the API refuses the field there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dllm_serve.decoding.protocol import StepLogits
from dllm_serve.decoding.sampler import dense_rows
from dllm_serve.models.attention import to_device

# A logprob entry: (token id, logprob, ((alternative id, logprob), ...)).
Entry = tuple[int, float, tuple[tuple[int, float], ...]]


@dataclass(slots=True)
class _Row:
    index: int  # the row in the step's batch
    state: Any
    log_probs: torch.Tensor  # [rows, V], mask id at -inf
    positions: list[int]  # masked diffusion: canvas positions of the result's columns
    specs: list[int] | None = None  # self-speculation: the drafts this forward verifies
    offset: int = 0  # self-speculation: the result column of the row's first own token


def before_sample(states: Sequence[Any], logits: StepLogits, mask_id: int) -> list[_Row]:
    """The log-softmax at the requested rows of every row that asks for logprobs (taken
    before the sampler, which may overwrite the logits)."""
    asking = [r for r, s in enumerate(states) if s.params.logprobs is not None]
    if not asking:
        return []
    rows = []
    for r, z in dense_rows(logits, asking).items():
        state = states[r]
        if hasattr(state, "emitted"):  # self-speculation
            verified = _verified(state)
            if verified is None:
                continue  # a draft forward: it emits nothing
            specs, offset = verified
            positions: list[int] = []
            z = z[: len(specs) + 1]
        else:
            specs, offset = None, 0
            positions = list(state.editable if getattr(state, "editing", False) else state.masked)
            if not positions:
                continue  # a prefill, or a step that asks for no masked position
            z = z[: len(positions)]
        z = z.float().clone()
        z[:, mask_id] = float("-inf")
        rows.append(_Row(r, state, torch.log_softmax(z, dim=-1), positions, specs, offset))
    return rows


def _verified(state: Any) -> tuple[list[int], int] | None:
    """A self-speculative row's verified drafts and the result column of its first own
    token; None for a forward that only drafts. ISD's result starts with its verdict column;
    LinearSpec's are the tokens themselves."""
    if hasattr(state, "round_shape"):  # ISD (and ``ar``): rows 0..k predict spec_i, then clean
        k, _ = state.round_shape
        return list(state.specs[:k]), 1
    if state.phase == "draft":
        return None
    return (list(state.specs) if state.phase == "verify" else []), 0


def after_sample(rows: Sequence[_Row], result: torch.Tensor, mask_id: int) -> None:
    """Write the entries of this step's tokens (device only; ``result`` is the sampler's
    ``[R, W]``, still on the device)."""
    for row in rows:
        state = row.state
        if row.specs is not None:
            n = len(row.specs) + 1
            own = result[row.index, row.offset : row.offset + n].to(torch.long)
            specs = to_device(row.specs, own.device, torch.long)
            state.logprob_staged = (
                _entries(row.log_probs[: n - 1], specs, state.params.logprobs),
                _entries(row.log_probs, own, state.params.logprobs),
            )
            continue
        n = len(row.positions)
        tokens = result[row.index, :n].to(torch.long)
        entry = _entries(row.log_probs, tokens, state.params.logprobs)
        buffer = _buffer(state, len(state.tokens) - state.prompt_len, entry)
        at = to_device([p - state.prompt_len for p in row.positions], entry.device, torch.long)
        buffer[at] = torch.where((tokens != mask_id)[:, None], entry, buffer[at])


def mark(state: Any) -> tuple[int, int] | None:
    """Before a self-speculative row's commit: (tokens emitted, drafts accepted) so far, from
    which :func:`after_commit` knows what this round emitted (None: nothing to record)."""
    if getattr(state, "logprob_staged", None) is None:
        return None
    return len(state.emitted), state.accepted_drafts


def after_commit(state: Any, before: tuple[int, int]) -> None:
    """Record the entries of the tokens a self-speculative round emitted: the round emits its
    first ``accepted`` drafts and then the verifier's token, cut at a stop id or max tokens
    (``SelfSpecState.end_round``), so token ``i`` of the round is draft ``i`` while
    ``i < accepted`` (counted as used), else the row's own token."""
    staged, state.logprob_staged = state.logprob_staged, None
    emitted, accepted = before
    new = len(state.emitted) - emitted
    if new <= 0 or staged is None:
        return
    spec_entries, own_entries = staged
    used = min(state.accepted_drafts - accepted, new)
    entries = torch.cat([spec_entries[:used], own_entries[used:new]])
    buffer = _buffer(state, state.params.gen_length, entries)
    buffer[emitted : emitted + new] = entries


def _entries(log_probs: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """``[n, 2 + 2k]``: each token's id and logprob, then the top ``k`` ids and logprobs."""
    chosen = log_probs.gather(1, tokens.clamp(0, log_probs.shape[1] - 1)[:, None])
    parts = [tokens[:, None].float(), chosen]
    if k:
        top = log_probs.topk(k, dim=-1)
        parts += [top.indices.float(), top.values]
    return torch.cat(parts, dim=1)


def _buffer(state: Any, rows: int, like: torch.Tensor) -> torch.Tensor:
    if state.logprob_buffer is None:
        state.logprob_buffer = like.new_zeros(rows, like.shape[1])
    return state.logprob_buffer


def read_entries(state: Any, start: int, end: int) -> tuple[Entry, ...]:
    """The entries of answer tokens ``[start, end)`` (one device→host copy)."""
    if end <= start or state.logprob_buffer is None:
        return ()
    k = state.params.logprobs
    out = []
    for values in state.logprob_buffer[start:end].tolist():
        alternatives = tuple((int(values[2 + j]), values[2 + k + j]) for j in range(k))
        out.append((int(values[0]), values[1], alternatives))
    return tuple(out)
