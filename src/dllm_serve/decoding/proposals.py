"""One denoising step's proposals and their confidences, for every row at once.

At each still-masked position the sampler proposes ``x0`` (the argmax at T = 0, else a
Gumbel-max sample from ``softmax(z / T)`` drawn from the request's own generator) and scores it
with the request's confidence metric (``decoding/confidence.py``). Dense logits are consumed
here; vocabulary-sharded ones (tensor parallelism) are reduced per rank and never gathered
(``decoding/sharded_vocab.py``).
"""

from __future__ import annotations

import torch

from dllm_serve.decoding.confidence import entropy_inverse_of
from dllm_serve.decoding.host_values import to_device
from dllm_serve.decoding.sampling import argmax, gumbel_argmax
from dllm_serve.decoding.sharded_vocab import ShardedLogits, is_sharded, writable

# Row → (temperature, generator) of the rows that draw this step.
Draws = dict[int, tuple[float, torch.Generator | None]]


def propose(
    logits: torch.Tensor | ShardedLogits,
    mask_id: int,
    counts: list[int],
    draws: Draws,
    metrics: list[str],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Proposals ``[R, M]`` and each row's confidence under its own metric ``[R, M]``.

    ``logits`` ``[R, M, V]``: row ``r``'s first ``counts[r]`` entries are its masked positions
    (padding after, scored but never committed by the caller). The mask id is a real vocabulary
    entry; proposing it would "commit" a mask and break the count (dInfer guards the same way),
    so it is excluded, which also removes it from the distribution the confidence is computed
    under.
    """
    if is_sharded(logits):
        x0, top1, inverse = logits.propose(mask_id, counts, draws)
        return x0, _pick_metric(metrics, top1, inverse, x0.device)
    # In place: the logits are this step's and are not read again.
    z = writable(logits.float())
    z.select(-1, mask_id).fill_(float("-inf"))
    sampled = {
        r: gumbel_argmax(z[r, : counts[r]], temperature, generator)
        for r, (temperature, generator) in draws.items()
    }
    x0 = argmax(z)  # greedy proposals (the first maximum, as torch.argmax)
    for r, tokens in sampled.items():
        x0[r, : tokens.shape[0]] = tokens
    # One fused softmax serves both metrics: top1_prob is p[x0] (LLaDA's low_confidence, the
    # untempered probability of the proposal), entropy_inverse is exp(−H(p)). The proposals
    # are drawn, so on CPU it overwrites the logits (no fresh [R, M, V] buffer to fault in
    # every step); the CUDA caching allocator makes a new one free there.
    cpu = z.device.type == "cpu"
    probs = torch.softmax(z, dim=-1, out=z) if cpu else torch.softmax(z, -1)
    if set(metrics) == {"entropy_inverse"}:
        return x0, entropy_inverse_of(probs)
    top1 = probs.gather(-1, x0.unsqueeze(-1)).squeeze(-1)
    if "entropy_inverse" not in metrics:
        return x0, top1
    return x0, _pick_metric(metrics, top1, entropy_inverse_of(probs), z.device)


def _pick_metric(
    metrics: list[str], top1: torch.Tensor, inverse: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """Each row's confidence under its own metric, ``[R, M]``."""
    if all(m == "top1_prob" for m in metrics):
        return top1
    if all(m == "entropy_inverse" for m in metrics):
        return inverse
    entropic = to_device([m == "entropy_inverse" for m in metrics], device)
    return torch.where(entropic[:, None], inverse, top1)
