"""Confidence of a proposed token: which masked positions are committed first."""

from __future__ import annotations

import torch


def top1_prob(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``softmax(logits)[n, tokens[n]]`` per row, in float64 (shape ``[N]``).

    This is LLaDA's ``low_confidence`` score: the probability, under the *untempered* model
    distribution, of the token that was proposed (the argmax at T = 0, the sampled token at
    T > 0). It is computed as ``exp(z[token] - logsumexp(z))`` so the full ``[N, V]`` softmax is
    never materialised; float64 keeps near-equal confidences from collapsing into ties (LLaDA's
    Gradio app, Fast-dLLM and LocalLeap also rank in float64).
    """
    z = logits.to(torch.float64)
    chosen = z.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return torch.exp(chosen - torch.logsumexp(z, dim=-1))
