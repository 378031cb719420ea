"""The exact verify/sample kernel of introspective strided decoding (speculative sampling).

Notation: ``p`` is the target distribution at a verify position (the model's own next-token
distribution given the committed prefix), ``q`` the distribution a draft token ``x`` was
*sampled* from. The rule (Leviathan et al. 2023; Chen et al. 2023):

    accept x with probability a(x) = min(1, p(x) / q(x));
    on rejection, sample from r = max(0, p − q) / Σ max(0, p − q).

The output is distributed exactly as p: P(out = y) = q(y)·a(y) + (1 − Σ_x q(x)a(x))·r(y)
= min(p, q)(y) + (Σ_y max(0, p − q)(y))·r(y) = min(p, q)(y) + max(0, p − q)(y) = p(y),
because Σ_x min(p, q)(x) = 1 − Σ max(0, p − q). This needs ``x ~ q``. The published I-DLM
server takes x = argmax q but still tests min(1, p/q) and resamples from max(0, p − q): that
mix is biased (e.g. p = [.5, .3, .2], q = [.4, .35, .25] always emits token 0), so it is not
offered here; ``tests/unit/decoding/test_decoding_isd_rule.py`` shows the deviation.

All arithmetic is float64 and every random number comes from the request's own generator.
"""

from __future__ import annotations

import torch

from dllm_serve.decoding.sampling import argmax
from dllm_serve.decoding.sharded_vocab import ShardedLogits, is_sharded


def target_probs(logits: torch.Tensor, temperature: float, mask_id: int) -> torch.Tensor:
    """``softmax(logits / T)`` in float64 with the mask id removed, rows ``[R, V]``.

    The mask id is a real vocabulary entry; it must never be emitted, and it is excluded the
    same way everywhere (verify, clean, correction and drafts) so p is one consistent target.
    """
    z = logits.to(torch.float64, copy=True)
    z[..., mask_id] = float("-inf")
    return torch.softmax(z / temperature, dim=-1)


def greedy_tokens(logits: torch.Tensor | ShardedLogits, mask_id: int) -> torch.Tensor:
    """``argmax`` per row with the mask id excluded (the T = 0 limit of :func:`target_probs`).

    In the logits' own precision (widening to float64 is exact, so it cannot change an argmax)
    and in place: the mask id's logits are set to −inf. Sharded logits (tensor parallelism)
    are reduced per rank instead, untouched.
    """
    if is_sharded(logits):
        return logits.greedy(mask_id)
    logits[..., mask_id] = float("-inf")
    return argmax(logits)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One exact draw per row of ``probs`` ``[R, V]`` (exponential race, float64).

    ``argmin_i E_i / p_i`` with ``E_i ~ Exp(1)`` i.i.d. picks ``i`` with probability
    ``p_i / Σ p`` (the minimum of independent Exp(p_i) clocks); zero-probability entries get
    an infinite clock and are never picked. Same law as Gumbel-max, without logs of p.
    """
    u = torch.rand(probs.shape, generator=generator, dtype=torch.float64, device=probs.device)
    clocks = -torch.log(u) / probs  # p = 0 → inf; u = 0 → inf (never the argmin)
    return clocks.argmin(dim=-1)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The correction distribution ``max(0, p − q)`` normalised.

    It sums to zero only when p == q, where every draft is accepted and the residual is
    never used; we then return p so the function is total.
    """
    r = torch.clamp(p - q, min=0.0)
    total = r.sum()
    return p if float(total) <= 0.0 else r / total


def verify_row(
    p: torch.Tensor, q: torch.Tensor, specs: torch.Tensor, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The speculative-sampling check of K drafts ``specs ~ q`` against ``p`` (``[K, V]``),
    with no value read back: ``(accepted, corrections)``.

    ``accepted`` (0-d) is the number of leading drafts that pass ``u_i · q_i(x_i) < p_i(x_i)``
    (``u < a`` without a division; a ≥ 1 always accepts since u < 1). ``corrections`` ``[K]``
    holds a sample of ``residual(p_i, q_i)`` for every i, drawn up front so the generator's
    consumption depends on K alone; only the one at the first rejection is ever used. Every
    random number is independent of the others, so the emitted token is still exactly
    p-distributed.
    """
    k = specs.shape[0]
    rows = torch.arange(k, device=p.device)
    u = torch.rand(k, generator=generator, dtype=torch.float64, device=p.device)
    ok = u * q[rows, specs] < p[rows, specs]
    accepted = ok.long().cumprod(0).sum()
    r = torch.clamp(p - q, min=0.0)
    total = r.sum(dim=-1, keepdim=True)
    corrections = sample(torch.where(total > 0, r / total.clamp_min(1e-300), p), generator)
    return accepted, corrections
