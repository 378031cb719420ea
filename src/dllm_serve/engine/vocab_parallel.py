"""The vocab-parallel sampler's collectives: rank 0 samples logits it never gathers whole.

After a tensor-parallel forward every rank holds its vocabulary slice of the step's logits
(``[R, M, V / N]``). Rank 0's :class:`VocabShardedLogits` is what the decoding algorithms
sample (``decoding/sharded_vocab.py`` has the math); each of its methods that needs the other
ranks is one :class:`VocabOp`: rank 0 computes its own part first (so a bad argument fails
there, before any worker is involved), announces the op on the control channel, and every
rank runs :func:`apply` on its slice and joins one ``gather`` to rank 0. A worker runs the
ops it is told until the next step (``engine/tensor_parallel.py``).

One op is never announced: right after the forward every rank reduces all rows greedily (the
model's mask id excluded) and gathers that on rank 0 (:func:`reduce_greedy`,
:meth:`VocabShardedLogits.take_greedy`). Every algorithm proposes argmaxes every step, so
a greedy step costs one gather of statistics and no control message; only Gumbel rows and
whole-row gathers announce ops of their own.

Traffic per step: 6 float64 per position for proposals and confidences, instead of ``V / N``
floats per position and rank; whole rows only for the rows whose rule needs the whole
distribution (``dense``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from dllm_serve.decoding.host_values import to_device
from dllm_serve.decoding.sharded_vocab import (
    Proposals,
    combine_statistics,
    gumbel_keys,
    shard_statistics,
)
from dllm_serve.models.tensor_parallel import TPShard

if TYPE_CHECKING:
    from dllm_serve.engine.tensor_parallel import TensorParallelGroup

REDUCE = "reduce"  # control message: run this VocabOp on the last step's logits


@dataclass
class VocabTraffic:
    """What the sampler's reductions brought to rank 0: ``collectives`` gathers,
    ``reduced_positions`` positions reduced to statistics, ``dense_rows`` rows gathered whole,
    ``bytes`` received from the other ranks."""

    collectives: int = 0
    reduced_positions: int = 0
    dense_rows: int = 0
    bytes: int = 0


@dataclass(frozen=True)
class VocabOp:
    """One reduction of the step's logits, the same on every rank.

    ``rows``: the step's rows it reads (None: all). ``propose`` returns proposal statistics
    (``mask_id``; ``draws``: ``(row, count, temperature, generator state)`` for the rows that
    sample, ``row`` an index into ``rows``); ``dense`` returns the rows' logits.
    """

    kind: str  # "propose" | "dense"
    rows: tuple[int, ...] | None = None
    mask_id: int = -1
    draws: tuple[tuple[int, int, float, torch.Tensor], ...] = ()


def apply(
    op: VocabOp,
    local: torch.Tensor,
    shard: TPShard,
    generators: dict[int, torch.Generator] | None = None,
) -> torch.Tensor:
    """This rank's part of ``op`` on its slice ``local`` ``[R, M, V / N]``; ``generators``
    (rank 0) are the live generators of the sampling rows, advanced by the draw; the other
    ranks rebuild each from the state carried by the op."""
    if op.rows is not None:
        local = local.index_select(0, to_device(op.rows, local.device))
    if op.kind == "dense":
        return local.contiguous()
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
