"""Log-probabilities of answer tokens (``logprobs`` / ``top_logprobs``), for diffusion decoding.

An autoregressive engine reports, for each answer token, its log-probability under the
distribution it was sampled from. Here a token is *committed* by one forward of a denoising
step, so its logprob is taken from that forward's logits at its position: the log-softmax over
the vocabulary with the mask id excluded (the distribution proposals are drawn from), and the
``k`` most likely tokens there as the alternatives. A token written again later (token editing)
takes the logprob of the forward that wrote it last.

It costs nothing on the step's one device→host copy. Before the batched sampler consumes the
logits, the log-softmax of each asking row's requested positions is taken (a copy);
after it, the logprob of whatever each position committed and the top ``k`` are written, on
the device, into the request's buffer (one row per answer position). The host reads a
request's buffer only when tokens of it become final (one small copy in those steps, for
those requests only).

Which algorithms: those whose step result lists, per row, the token committed at each of the
row's requested positions in order (``mask_id`` where nothing was): canvas denoising (LLaDA,
Dream, LLaDA-MoE) and block diffusion (SDAR, LLaDA2.x, editing included). The registry says
which (``supports_logprobs``); the others refuse the field.
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
    positions: list[int]  # canvas positions of the row's result columns, in order
    log_probs: torch.Tensor  # [len(positions), V], mask id at -inf


def before_sample(states: Sequence[Any], logits: StepLogits, mask_id: int) -> list[_Row]:
    """The log-softmax at the requested positions of every row that asks for logprobs (taken
    before the sampler, which may overwrite the logits)."""
    asking = [r for r, s in enumerate(states) if s.params.logprobs is not None]
    if not asking:
        return []
    rows = []
    for r, z in dense_rows(logits, asking).items():
        state = states[r]
        positions = list(state.editable if getattr(state, "editing", False) else state.masked)
        if not positions:
            continue  # a prefill, or a step that asks for no masked position
        z = z[: len(positions)].float().clone()
        z[:, mask_id] = float("-inf")
        rows.append(_Row(r, state, positions, torch.log_softmax(z, dim=-1)))
    return rows


def after_sample(rows: Sequence[_Row], committed: torch.Tensor, mask_id: int) -> None:
    """Write each row's committed tokens' logprobs and alternatives into its request's buffer
    (device only; ``committed`` is the sampler's ``[R, W]`` result, still on the device)."""
    for row in rows:
        state, n = row.state, len(row.positions)
        k = state.params.logprobs
        tokens = committed[row.index, :n].to(torch.long)
        wrote = tokens != mask_id
        chosen = row.log_probs.gather(1, tokens.clamp(0, row.log_probs.shape[1] - 1)[:, None])
        top = row.log_probs.topk(k, dim=-1) if k else None
        parts = [tokens[:, None].float(), chosen]
        if top is not None:
            parts += [top.indices.float(), top.values]
        entry = torch.cat(parts, dim=1)  # [n, 2 + 2k]: id, logprob, alternative ids, logprobs
        buffer = state.logprob_buffer
        if buffer is None:
            buffer = torch.zeros(len(state.tokens) - state.prompt_len, 2 + 2 * k,
                                 device=entry.device)  # fmt: skip
            state.logprob_buffer = buffer
        at = to_device([p - state.prompt_len for p in row.positions], entry.device, torch.long)
        buffer[at] = torch.where(wrote[:, None], entry, buffer[at])


def read_entries(state: Any, start: int, end: int) -> tuple[Entry, ...]:
    """The entries of answer tokens ``[start, end)`` (one device→host copy)."""
    if end <= start or state.logprob_buffer is None:
        return ()
    k = state.params.logprobs
    out = []
    for values in state.logprob_buffer[start:end].tolist():
        alternatives = tuple(
            (int(values[2 + j]), values[2 + k + j]) for j in range(k)
        )  # fmt: skip
        out.append((int(values[0]), values[1], alternatives))
    return tuple(out)
