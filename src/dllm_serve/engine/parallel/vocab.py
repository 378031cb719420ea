"""The vocab-parallel sampler's collectives: rank 0 samples logits it never gathers whole.

After a tensor-parallel forward every rank holds its vocabulary slice of the step's logits
(``[R, M, V / N]``). Rank 0's :class:`VocabShardedLogits` is what the decoding algorithms
sample (the math below); each of its methods that needs the other
ranks is one :class:`VocabOp`: rank 0 computes its own part first (so a bad argument fails
there, before any worker is involved), announces the op on the control channel, and every
rank runs :func:`apply` on its slice and joins one ``gather`` to rank 0. A worker runs the
ops it is told until the next step (``engine/workers.py``).

One op is never announced: right after the forward every rank reduces all rows greedily (the
model's mask id excluded) and gathers that on rank 0 (:func:`reduce_greedy`,
:meth:`VocabShardedLogits.take_greedy`). Every algorithm proposes argmaxes every step, so
a greedy step costs one gather of statistics and no control message; only Gumbel rows and
whole-row gathers announce ops of their own.

Traffic per step: 6 float64 per position for proposals and confidences, instead of ``V / N``
floats per position and rank; whole rows only for the rows whose rule needs the whole
distribution (``dense``).

**The math.** Under tensor parallelism each rank's LM head produces the logits of its
vocabulary slice ``[R, M, V / N]``. Gathering them brings ``(N − 1)/N · R·M·V`` floats to rank
0 every step (at TP 2, 16 rows × 32 positions of LLaDA-8B's 126k vocabulary: 129.5 MB). What
the samplers need per position is much less:

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
distribution (speculative verification, inverse-CDF samples at T > 0, and the rows under a
structured-output grammar, whose mask and lookahead run on dense logits:
``decoding/sampler.py`` ``sample_split``) gather just those rows (:meth:`ShardedLogits.dense`).

**Self-conditioning** (DiffusionGemma, :meth:`VocabShardedLogits.soft_product`): a denoising
row's next input is ``softmax(z / T) @ E`` over the whole vocabulary, and each rank holds the
logits *and* the embedding rows of its slice, so the product is a sum over the ranks of
``softmax(z / T)[slice r] @ E_r``. The softmax's normaliser is the whole row's: each rank
reduces its slice to ``max`` and ``Σ exp(z − max)``, two all-reduces make them global, and
each rank's probabilities are ``exp(z − M) / S`` as the dense softmax computes them. Rank 0
sums the ``[C, D]`` parts in rank order (in fp32). Only rounding differs from the dense
product: the order of the sums, and in half precision each rank's part is rounded to the
model's dtype before the sum. Cost per
denoising row and step: two all-reduces of ``C`` floats and one gather of ``(N − 1) · C · D``
floats, against the whole row's ``(N − 1)/N · C · V`` of the dense gather the renoise sampler
makes anyway.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dllm_serve.decoding.protocol import Proposals
from dllm_serve.decoding.sampler import argmax
from dllm_serve.engine.parallel.group import REDUCE, TensorParallelGroup, VocabTraffic
from dllm_serve.models.attention import to_device
from dllm_serve.models.sharding import TPShard

# Columns of a shard's statistics (float64, so token ids up to 2^53 travel exactly).
KEY, TOKEN, Z_AT_TOKEN, MAX, SUM_EXP, SUM_EXP_Z = range(6)
STATISTICS = 6


def gumbel_keys(z: torch.Tensor, temperature: float, uniforms: torch.Tensor) -> torch.Tensor:
    """``z + T·g`` in float64 with ``g = −log(−log u)``: the Gumbel-max keys whose argmax is a
    sample of ``softmax(z / T)`` (see :func:`~dllm_serve.decoding.sampler.gumbel_argmax`,
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


@dataclass(frozen=True)
class VocabOp:
    """One reduction of the step's logits, the same on every rank.

    ``rows``: the step's rows it reads (None: all). ``propose`` returns proposal statistics
    (``mask_id``; ``draws``: ``(row, count, temperature, generator state)`` for the rows that
    sample, ``row`` an index into ``rows``); ``dense`` returns the rows' logits; ``soft``
    returns this rank's part of each row's self-conditioning product at the row's
    ``temperatures`` (``cast``: the dtype the tempered logits are rounded to first).
    """

    kind: str  # "propose" | "dense" | "soft"
    rows: tuple[int, ...] | None = None
    mask_id: int = -1
    draws: tuple[tuple[int, int, float, torch.Tensor], ...] = ()
    temperatures: tuple[float, ...] = ()
    cast: torch.dtype | None = None


def apply(
    op: VocabOp,
    local: torch.Tensor,
    shard: TPShard,
    generators: dict[int, torch.Generator] | None = None,
    soft_product: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """This rank's part of ``op`` on its slice ``local`` ``[R, M, V / N]``; ``generators``
    (rank 0) are the live generators of the sampling rows, advanced by the draw; the other
    ranks rebuild each from the state carried by the op. ``soft_product``: the model's
    ``probs @ E_r`` over this rank's embedding rows (a ``soft`` op needs it)."""
    if op.rows is not None:
        local = local.index_select(0, to_device(op.rows, local.device))
    if op.kind == "dense":
        return local.contiguous()
    if op.kind == "soft":
        if soft_product is None:
            raise ValueError("a self-conditioning reduction needs the model's soft_product")
        return soft_part(local, op.temperatures, op.cast, shard, soft_product)
    rows, width, vocab = local.shape
    offset = shard.rank * vocab
    z = local.float()
    if offset <= op.mask_id < offset + vocab:  # only one rank holds the mask id
        z = z.clone()
        z[..., op.mask_id - offset] = float("-inf")
    keys: dict[int, torch.Tensor] = {}
    for row, count, temperature, state in op.draws:
        generator = (generators or {}).get(row)
        if generator is None:
            generator = torch.Generator(device=local.device)
            generator.set_state(state)
        # The draw over the *whole* vocabulary, as at TP = 1: the same uniforms on every rank
        # (and the generator advanced alike); each rank keeps its columns.
        uniforms = torch.rand(
            (count, vocab * shard.size), generator=generator, dtype=torch.float64,
            device=local.device,
        )[:, offset : offset + vocab]  # fmt: skip
        for j, noise in enumerate(gumbel_keys(z[row, :count], temperature, uniforms)):
            keys[row * width + j] = noise
    return shard_statistics(z.view(rows * width, vocab), offset, keys).view(rows, width, -1)


def soft_part(
    local: torch.Tensor,
    temperatures: Sequence[float],
    cast: torch.dtype | None,
    shard: TPShard,
    soft_product: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """This rank's ``softmax(z / T)[slice] @ E_r`` ``[R, M, D]`` (fp32) for its slice ``local``
    ``[R, M, V / N]`` of the rows' logits, row ``i`` at ``temperatures[i]`` (the module
    docstring). Every rank must call it together: its two all-reduces make the normaliser the
    whole vocabulary's."""
    t = torch.tensor(temperatures, dtype=torch.float32, device=local.device)[:, None, None]
    # Elementwise, so each rank's tempered logits are bit for bit the dense row's columns.
    z = local.float() / t
    if cast is not None:  # the dense sampler's softmax reads the logits in the model's dtype
        z = z.to(cast).float()
    top = z.amax(dim=-1)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=shard.group)
    e = torch.exp(z - top.unsqueeze(-1))
    total = e.sum(dim=-1)
    dist.all_reduce(total, group=shard.group)
    return soft_product(e / total.unsqueeze(-1)).float()


def reduce_greedy(local: torch.Tensor, shard: TPShard, mask_id: int) -> None:
    """A worker's part of every step's first reduction, unasked: the greedy statistics of
    all rows (``mask_id`` excluded), gathered on rank 0 (:meth:`VocabShardedLogits.take_greedy`).
    Every algorithm needs them every step, so announcing them would only add a message."""
    gather_parts(apply(VocabOp("propose", None, mask_id), local, shard), shard)


def gather_parts(part: torch.Tensor, shard: TPShard) -> list[torch.Tensor] | None:
    """Every rank's ``part`` on rank 0 (in rank order); None on the other ranks."""
    parts = [torch.empty_like(part) for _ in range(shard.size)] if shard.rank == 0 else None
    dist.gather(part.contiguous(), parts, dst=0, group=shard.group)
    return parts


@dataclass
class VocabShardedLogits:
    """Rank 0's :class:`~dllm_serve.decoding.sharded_vocab.ShardedLogits`: its own slice of
    the step's logits, and the group that holds the others."""

    local: torch.Tensor  # [R, M, V / N] of the step (all rows)
    shard: TPShard
    group: TensorParallelGroup | None  # None: a launcher-started group with no handle (tests)
    rows: tuple[int, ...] | None = None
    # What reached rank 0 (``VocabTraffic``): the group's running totals, or this step's own.
    traffic: VocabTraffic = field(default_factory=VocabTraffic)
    # The greedy proposals of every row (the model's mask id excluded), reduced by every rank
    # right after the forward (:meth:`take_greedy`): what most steps need, with no message.
    greedy_of: tuple[int, Proposals] | None = None
    # The model's ``probs @ E_r`` over this rank's embedding rows (DiffusionGemma's
    # self-conditioning, :meth:`soft_product`); None for the other families.
    embedding_product: Callable[[torch.Tensor], torch.Tensor] | None = None

    def take_greedy(self, mask_id: int) -> VocabShardedLogits:
        """Rank 0's part of :func:`reduce_greedy`, which every rank runs right after the
        forward: the step's greedy proposals, kept for :meth:`propose`. Returns ``self``."""
        mine = apply(VocabOp("propose", None, mask_id), self.local, self.shard)
        parts = self._collect(None, mine)
        self.greedy_of = (mask_id, self._combine(parts))
        return self

    @property
    def shape(self) -> torch.Size:
        n = self.local.shape[0] if self.rows is None else len(self.rows)
        return torch.Size((n, self.local.shape[1], self.local.shape[2] * self.shard.size))

    @property
    def device(self) -> torch.device:
        return self.local.device

    def select_rows(self, rows: Sequence[int]) -> VocabShardedLogits:
        base = tuple(self.rows[r] for r in rows) if self.rows is not None else tuple(rows)
        return dataclasses.replace(self, rows=base)  # the same step: traffic and greedy_of

    def greedy(self, mask_id: int) -> torch.Tensor:
        return self.propose(mask_id, [], {}).tokens

    def propose(
        self,
        mask_id: int,
        counts: Sequence[int],
        draws: dict[int, tuple[float, torch.Generator | None]],
    ) -> Proposals:
        if any(g is None for _t, g in draws.values()):
            raise ValueError("a sampled row needs its request's generator")
        greedy = self._greedy(mask_id)
        if greedy is not None and not draws:
            return greedy
        # Only the sampling rows when the greedy ones are known already, else every row.
        ours = sorted(draws) if greedy is not None else list(range(self.shape[0]))
        view = self.select_rows(ours)
        # A draw's row is an index into the op's rows (``apply`` selects them first); rank 0
        # draws from the live generators, advancing them as a draw at TP = 1 does.
        live = {ours.index(r): generator for r, (_t, generator) in draws.items()}
        op = VocabOp(
            "propose", view.rows, mask_id,
            tuple((i, counts[ours[i]], draws[ours[i]][0], g.get_state()) for i, g in live.items()),
        )  # fmt: skip
        sampled = self._combine(self._collect(op, apply(op, self.local, self.shard, live)))
        if greedy is None:
            return sampled
        index = to_device(ours, sampled.tokens.device)
        return Proposals(*(g.index_copy(0, index, t) for g, t in zip(greedy, sampled, strict=True)))

    def _greedy(self, mask_id: int) -> Proposals | None:
        """This view's rows of the greedy proposals every rank reduced after the forward
        (None: not reduced, or for another mask id)."""
        if self.greedy_of is None or self.greedy_of[0] != mask_id:
            return None
        done = self.greedy_of[1]
        if self.rows is None:
            return done
        index = to_device(self.rows, done.tokens.device)
        return Proposals(*(t.index_select(0, index) for t in done))

    def _combine(self, parts: list[torch.Tensor]) -> Proposals:
        self.traffic.reduced_positions += parts[0].shape[0] * parts[0].shape[1]
        tokens, top1, inverse = combine_statistics(torch.stack(parts))
        # float32 confidences, as the dense sampler's float32 softmax gives.
        return Proposals(tokens, top1.float(), inverse.float())

    def dense(self, rows: Sequence[int]) -> torch.Tensor:
        view = self.select_rows(rows)
        op = VocabOp("dense", view.rows)
        parts = self._collect(op, apply(op, self.local, self.shard))
        self.traffic.dense_rows += len(rows)
        return torch.cat(parts, dim=-1)

    def soft_product(
        self, rows: Sequence[int], temperatures: Sequence[float], cast: torch.dtype | None
    ) -> torch.Tensor:
        """``softmax(z / T) @ E`` ``[len(rows), M, D]`` (fp32, on rank 0) over the whole
        vocabulary for ``rows`` of the step's logits, row ``i`` at ``temperatures[i]`` (the
        module docstring): each rank's part summed in rank order."""
        if self.embedding_product is None:
            raise ValueError("this model has no self-conditioning product")
        view = self.select_rows(rows)
        op = VocabOp("soft", view.rows, temperatures=tuple(temperatures), cast=cast)
        # Announced before rank 0 computes its own part: the part's all-reduces need every
        # rank in them (the other ops compute first, so that a bad argument fails alone).
        if self.group is not None:
            self.group.send((REDUCE, op))
        try:
            mine = apply(op, self.local, self.shard, soft_product=self.embedding_product)
        except (RuntimeError, OSError) as exc:  # an all-reduce failed: a rank is gone
            if self.group is not None:
                self.group.fail(f"tensor-parallel collective failed: {exc}")
            raise
        parts = self._collect(None, mine)
        self.traffic.collectives += 2  # the normaliser's two all-reduces
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total

    def _collect(self, op: VocabOp | None, mine: torch.Tensor) -> list[torch.Tensor]:
        """Announce ``op`` (None: the ranks run it unasked, :func:`reduce_greedy`), then
        gather every rank's part of it."""
        if self.group is not None and op is not None:
            self.group.send((REDUCE, op))
        try:
            parts = gather_parts(mine, self.shard)
        except (RuntimeError, OSError) as exc:
            if self.group is not None:
                self.group.fail(f"tensor-parallel collective failed: {exc}")
            raise
        assert parts is not None
        self.traffic.collectives += 1
        self.traffic.bytes += sum(p.numel() * p.element_size() for p in parts[1:])
        return parts
