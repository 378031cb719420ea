"""Confidence of a proposed token: which masked positions are committed first.

Both metrics live on the same scale, ``(0, 1]`` with 1 = certain, so one threshold
(``confidence_threshold``, LocalLeap's κ and τ) means the same kind of thing under either.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def top1_prob(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``softmax(logits)[..., tokens]`` for logits ``[..., V]`` and tokens ``[...]``.

    This is LLaDA's ``low_confidence`` score: the probability, under the *untempered* model
    distribution, of the token that was proposed (the argmax at T = 0, the sampled token at
    T > 0). It is computed as ``exp(z[token] - logsumexp(z))``, in the logits' own float
    precision (float32 from the engine), so the ``[N, V]`` softmax is never materialised and
    no float64 copy of the logits is made: the argmax is unchanged by precision, and the score
    is a well-defined probability either way. Callers that want float64 rankings pass float64
    logits.
    """
    chosen = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return torch.exp(chosen - torch.logsumexp(logits, dim=-1))


def entropy_inverse(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``exp(−H(p))`` per row, ``p = softmax(logits)`` in the logits' precision, H in nats.

    ``exp(−H)`` is the inverse of the distribution's perplexity: ``1/k`` for a distribution
    uniform over ``k`` tokens, 1 for a one-hot one. We use it rather than ``−H`` or
    ``1/(1+H)`` because it keeps thresholds on the probability scale of :func:`top1_prob`:
    since ``H ≥ −log max_v p_v`` (Shannon entropy is at least the min-entropy),
    ``exp(−H) ≤ max_v p_v``, so a threshold of 0.9 on ``entropy_inverse`` is never looser
    than 0.9 on the greedy ``top1_prob`` — it additionally demands that the rest of the mass
    is not spread out. For top-k ranking it orders positions exactly as ``−H`` would (any
    strictly increasing transform of ``−H`` ranks identically; tested).

    It scores the whole predictive distribution, so ``tokens`` (the proposal) is not used:
    at T > 0 a position's confidence does not depend on which token was drawn. Entries at −∞
    (the suppressed mask id) have ``p = 0`` and contribute ``0·log 0 = 0``.
    """
    del tokens  # same signature as top1_prob; the entropy does not depend on the proposal
    return entropy_inverse_of(torch.softmax(logits, dim=-1))


def entropy_inverse_of(probs: torch.Tensor) -> torch.Tensor:
    """:func:`entropy_inverse` from probabilities ``[..., V]`` already computed."""
    entropy = -torch.special.xlogy(probs, probs).sum(dim=-1)
    # Rounding can make H of a one-hot row a hair negative; clamp so the score stays ≤ 1.
    return torch.exp(-entropy.clamp_min(0.0))


METRICS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "top1_prob": top1_prob,
    "entropy_inverse": entropy_inverse,
}


def confidence(name: str, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Dispatch to the metric called ``name`` (see ``DecodingParams.confidence_metric``)."""
    metric = METRICS.get(name)
    if metric is None:
        raise ValueError(f"unknown confidence_metric {name!r} (available: {sorted(METRICS)})")
    return metric(logits, tokens)
