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


def target_probs(logits: torch.Tensor, temperature: float, mask_id: int) -> torch.Tensor:
    """``softmax(logits / T)`` in float64 with the mask id removed, rows ``[R, V]``.

    The mask id is a real vocabulary entry; it must never be emitted, and it is excluded the
    same way everywhere (verify, clean, correction and drafts) so p is one consistent target.
    """
    z = logits.to(torch.float64, copy=True)
    z[:, mask_id] = float("-inf")
    return torch.softmax(z / temperature, dim=-1)


def greedy_tokens(logits: torch.Tensor, mask_id: int) -> torch.Tensor:
    """``argmax`` per row with the mask id excluded (the T = 0 limit of :func:`target_probs`)."""
    z = logits.to(torch.float64, copy=True)
    z[:, mask_id] = float("-inf")
    return z.argmax(dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One exact draw per row of ``probs`` ``[R, V]`` (exponential race, float64).

    ``argmin_i E_i / p_i`` with ``E_i ~ Exp(1)`` i.i.d. picks ``i`` with probability
    ``p_i / Σ p`` (the minimum of independent Exp(p_i) clocks); zero-probability entries get
    an infinite clock and are never picked. Same law as Gumbel-max, without logs of p.
    """
    u = torch.rand(probs.shape, generator=generator, dtype=torch.float64, device=probs.device)
    clocks = -torch.log(u) / probs  # p = 0 → inf; u = 0 → inf (never the argmin)
    return clocks.argmin(dim=-1)


def accept_probability(p: torch.Tensor, q: torch.Tensor, x: int) -> float:
    """``min(1, p(x) / q(x))`` for a draft ``x`` sampled from ``q`` (so ``q(x) > 0``)."""
    qx = float(q[x])
    if qx <= 0.0:  # impossible for a real draw from q; never accept what q could not produce
        return 0.0
    return min(1.0, float(p[x]) / qx)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The correction distribution ``max(0, p − q)`` normalised.

    It sums to zero only when p == q, where every draft is accepted and the residual is
    never used; we then return p so the function is total.
    """
    r = torch.clamp(p - q, min=0.0)
    total = r.sum()
    return p if float(total) <= 0.0 else r / total


def verify_draft(
    p: torch.Tensor, q: torch.Tensor, x: int, generator: torch.Generator | None
) -> tuple[bool, int]:
    """Speculative-sampling check of draft ``x ~ q`` against target ``p`` (both ``[V]``).

    Returns ``(True, x)`` on acceptance, else ``(False, y)`` with ``y ~ residual(p, q)``.
    ``u < a`` is tested as ``u · q(x) < p(x)`` in float64 (no division; a ≥ 1 always accepts
    since ``u < 1``).
    """
    u = float(torch.rand((), generator=generator, dtype=torch.float64, device=p.device))
    if u * float(q[x]) < float(p[x]):
        return True, x
    return False, int(sample(residual(p, q)[None], generator)[0])


def verify_specs(
    p: torch.Tensor, q: torch.Tensor, specs: list[int], generator: torch.Generator | None
) -> tuple[int, int | None]:
    """:func:`verify_draft` for K specs left to right, with one device→host copy for the test.

    ``p``/``q`` are ``[K, V]``. Returns ``(j, correction)`` where ``j`` specs were accepted and
    ``correction`` is a residual sample for spec ``j`` (None when all K were accepted). All K
    uniforms are drawn up front (the ones after a rejection are simply unused), which keeps
    the generator's consumption a function of K alone.
    """
    k = len(specs)
    if k == 0:
        return 0, None
    rows = torch.arange(k, device=p.device)
    x = torch.tensor(specs, device=p.device)
    u = torch.rand(k, generator=generator, dtype=torch.float64, device=p.device)
    ok = (u * q[rows, x] < p[rows, x]).tolist()
    j = ok.index(False) if False in ok else k
    if j == k:
        return k, None
    return j, int(sample(residual(p[j], q[j])[None], generator)[0])
