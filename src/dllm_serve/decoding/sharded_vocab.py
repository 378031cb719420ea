"""Logits whose vocabulary is split over tensor-parallel ranks, and the math that samples them
without ever gathering the full vocabulary.

Under tensor parallelism each rank's LM head produces the logits of its vocabulary slice
``[R, M, V / N]``. Gathering them brings ``(N − 1)/N · R·M·V`` floats to rank 0 every step
(at TP 2, 16 rows × 32 positions of LLaDA-8B's 126k vocabulary: 129.5 MB). What the samplers
need per position is much less:

- the **proposal**: the argmax with the mask id excluded, or at T > 0 a Gumbel-max sample
  ``argmax(z + T·g)``. A maximum over the vocabulary is the maximum of the shards' maxima,
  so each rank reduces its slice to ``(key, token, z[token])`` and the largest key wins (the
  lowest rank on a tie, which is the first maximum of the concatenation, as torch's argmax);
- the **confidence**: ``top1_prob = exp(z[x] − LSE)`` and ``entropy_inverse = exp(−H)``. With
  each shard's ``m_r = max z``, ``s_r = Σ exp(z − m_r)`` and ``t_r = Σ exp(z − m_r)(z − m_r)``,
  and ``M = max_r m_r``, ``w_r = exp(m_r − M)``, ``S = Σ w_r s_r``:

      LSE = M + log S,        H = log S − Σ_r w_r (t_r + (m_r − M) s_r) / S,

  because ``H = LSE − E_p[z]`` and ``E_p[z − M] = Σ_r w_r Σ_{v∈r} e^{z_v − m_r}(z_v − M) / S``.
  Both are exact identities; only float rounding differs from the dense softmax (as the TP
  all-reduce already makes the logits differ in their last bits).

So each rank sends 6 numbers per position (:func:`shard_statistics`) and rank 0 combines them
(:func:`combine_statistics`). Gumbel noise stays the request's own: every rank draws the same
``[m, V]`` uniforms from the request's generator state and uses its slice, so a seeded
sample at TP = N is exactly the sample at TP = 1. Rows whose rule needs the whole
distribution (speculative verification, inverse-CDF samples at T > 0) gather just those rows
(:meth:`ShardedLogits.dense`).

The algorithms accept either a dense tensor or a :class:`ShardedLogits`; the helpers here
(:func:`dense_rows`, :func:`select_rows`, :func:`seed_tokens`, :func:`writable`) let one
sampler serve both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol, runtime_checkable

import torch

from dllm_serve.decoding.host_values import to_device
from dllm_serve.decoding.sampling import argmax

# Columns of a shard's statistics (float64, so token ids up to 2^53 travel exactly).
KEY, TOKEN, Z_AT_TOKEN, MAX, SUM_EXP, SUM_EXP_Z = range(6)
STATISTICS = 6


class Proposals(NamedTuple):
    """Per position ``[R, M]``: the proposed token, ``top1_prob`` of it, ``entropy_inverse``."""

    tokens: torch.Tensor
    top1_prob: torch.Tensor
    entropy_inverse: torch.Tensor


@runtime_checkable
class ShardedLogits(Protocol):
    """Logits ``[R, M, V]`` of one step whose vocabulary lives on several ranks (rank 0's view).

    Every method that needs values from other ranks runs one collective; rank 0 is the only
    caller, in the engine's sampler.
    """

    @property
    def shape(self) -> torch.Size: ...

    @property
    def device(self) -> torch.device: ...

    def select_rows(self, rows: Sequence[int]) -> ShardedLogits:
        """The same logits restricted to ``rows`` (no communication)."""
        ...

    def greedy(self, mask_id: int) -> torch.Tensor:
        """``[R, M]`` argmax tokens with ``mask_id`` excluded."""
        ...

    def propose(
        self,
        mask_id: int,
        counts: Sequence[int],
        draws: dict[int, tuple[float, torch.Generator | None]],
    ) -> Proposals:
        """Argmax proposals (mask id excluded) and their confidences; row ``r`` in ``draws``
        instead samples its first ``counts[r]`` positions by Gumbel-max at its temperature
        from its generator (exactly as :func:`~dllm_serve.decoding.sampling.gumbel_argmax`
        on the full vocabulary, and advancing the generator alike)."""
        ...

    def dense(self, rows: Sequence[int]) -> torch.Tensor:
        """The full-vocabulary logits ``[len(rows), M, V]`` of ``rows`` (gathered)."""
        ...


def is_sharded(logits: object) -> bool:
    """Whether ``logits`` are sharded by vocabulary (anything but a dense tensor)."""
    return not isinstance(logits, torch.Tensor)


def writable(logits: torch.Tensor | ShardedLogits) -> torch.Tensor | ShardedLogits:
    """Logits a sampler may overwrite in place: dense ones themselves, or a copy of an
    inference-mode tensor used outside inference mode (tests); sharded ones as they are (their
    reductions never write)."""
    if (
        isinstance(logits, torch.Tensor)
        and logits.is_inference()
        and not torch.is_inference_mode_enabled()
    ):
        return logits.clone()
    return logits


def select_rows(
    logits: torch.Tensor | ShardedLogits, rows: Sequence[int]
) -> torch.Tensor | ShardedLogits:
    """``logits`` restricted to ``rows`` (a dense index_select or a sharded view)."""
    if isinstance(logits, torch.Tensor):
        return logits.index_select(0, to_device(rows, logits.device))
    return logits.select_rows(rows)


def dense_rows(
    logits: torch.Tensor | ShardedLogits, rows: Sequence[int]
) -> dict[int, torch.Tensor]:
    """Row ``r``'s full-vocabulary logits ``[M, V]`` for each ``r`` in ``rows`` (one gather
    for all of them when sharded; views otherwise)."""
    if not rows:
        return {}
    if isinstance(logits, torch.Tensor):
        return {r: logits[r] for r in rows}
    gathered = logits.dense(rows)
    return {r: gathered[i] for i, r in enumerate(rows)}


def seed_tokens(logits: torch.Tensor | ShardedLogits, mask_id: int) -> torch.Tensor:
    """``[R]``: each row's argmax at its first requested position, mask id excluded; the
    logits are left as they were."""
    if isinstance(logits, torch.Tensor):
        first = logits[:, 0].float().clone()
        first[:, mask_id] = float("-inf")
        return argmax(first).to(logits.device)
    return logits.greedy(mask_id)[:, 0]


def gumbel_keys(z: torch.Tensor, temperature: float, uniforms: torch.Tensor) -> torch.Tensor:
    """``z + T·g`` in float64 with ``g = −log(−log u)``: the Gumbel-max keys whose argmax is a
    sample of ``softmax(z / T)`` (see :func:`~dllm_serve.decoding.sampling.gumbel_argmax`,
    which takes the argmax of exactly this expression)."""
    return z.to(torch.float64) - temperature * torch.log(-torch.log(uniforms))


def shard_statistics(
    z: torch.Tensor, offset: int, keys: dict[int, torch.Tensor] | None = None
) -> torch.Tensor:
    """One shard's reduction of ``z`` ``[P, V_r]`` (vocabulary ids ``offset …``, the mask id
    already −inf): ``[P, 6]`` float64 with the columns named at the top of this module.

    ``keys`` maps a position to its Gumbel keys ``[V_r]`` (a sampled position); every other
    position's key is ``z`` itself (the argmax).
    """
    token = argmax(z).to(z.device)  # numpy's first-maximum argmax on CPU
    z_at = z.gather(-1, token.unsqueeze(-1)).squeeze(-1)
    key = z_at.to(torch.float64)
    if keys:
        positions = to_device(list(keys), z.device)
        stacked = torch.stack(list(keys.values()))
        best = stacked.argmax(-1)
        key = key.index_copy(0, positions, stacked.gather(-1, best[:, None]).squeeze(-1))
        token = token.index_copy(0, positions, best)
        z_at = z_at.index_copy(0, positions, z[positions].gather(-1, best[:, None]).squeeze(-1))
    m = z.max(dim=-1).values
    finite = torch.isfinite(m)
    d = (z - torch.where(finite, m, 0.0)[:, None]).clamp_min(torch.finfo(z.dtype).min)
    e = torch.exp(d)  # −inf entries (the mask id) give 0, and 0·(finite d) stays 0
    return torch.stack(
        [key, (token + offset).to(torch.float64), z_at.to(torch.float64), m.to(torch.float64),
         e.sum(-1).to(torch.float64), (e * d).sum(-1).to(torch.float64)],
        dim=-1,
    )  # fmt: skip


def combine_statistics(stats: torch.Tensor) -> Proposals:
    """Rank 0's combination of every shard's :func:`shard_statistics` ``[N, ..., 6]`` (shard
    ``r`` = vocabulary slice ``r``) into the proposals and confidences of the whole vocabulary
    (the formulas in the module docstring)."""
    winner = stats[..., KEY].argmax(dim=0, keepdim=True)  # first maximum: the lowest rank
    pick = stats.gather(0, winner.unsqueeze(-1).expand(1, *stats.shape[1:])).squeeze(0)
    m, s, t = stats[..., MAX], stats[..., SUM_EXP], stats[..., SUM_EXP_Z]
    top = m.max(dim=0).values
    finite = torch.isfinite(m)  # a shard holding only the mask id adds nothing
    gap = torch.where(finite, m - top, 0.0)
    w = torch.where(finite, torch.exp(gap), 0.0)
    total = (w * s).sum(0)
    mean_shifted = (w * (t + gap * s)).sum(0) / total  # E_p[z − M]
    log_total = torch.log(total)
    top1 = torch.exp(pick[..., Z_AT_TOKEN] - (top + log_total))
    entropy = (log_total - mean_shifted).clamp_min(0.0)  # rounding can dip a hair below 0
    return Proposals(pick[..., TOKEN].long(), top1, torch.exp(-entropy))
