"""ModelRunner: owns the device side of serving — the weights, the KV pool and the forward.

``run(rows)`` packs the rows of one step into a :class:`FlatBatch` (real tokens only; one
host→device copy for all of its index tensors), runs the model and the LM head at the
requested positions only, and returns logits ``[rows, M, V]`` with each row's requested
outputs first (``M`` = the most any row asked for; shorter rows are padded by repeating
their first output, which the algorithms mask out). Nothing here reads a device value back.
"""

from __future__ import annotations

import logging
import os
import time
from array import array
from typing import TYPE_CHECKING

import torch

from dllm_serve.decoding.forward_spec import AttentionKind, RowSpec
from dllm_serve.engine.cuda_graphs import MAX_Q, GraphRunner, StaticForward
from dllm_serve.models.flat_batch import AttnGroup, FlatBatch
from dllm_serve.models.kv_pool import KVPool
from dllm_serve.models.lora import PhaseHooks, weight_view_hooks
from dllm_serve.models.tensor_parallel import gather_vocab
from dllm_serve.models.transformer import DecoderTransformer

if TYPE_CHECKING:
    from dllm_serve.engine.tensor_parallel import TensorParallelGroup

logger = logging.getLogger(__name__)
INIT, RUN = "init", "run"  # control messages to tensor-parallel workers

_GIB = 1 << 30
CPU_DEFAULT_KV_GIB = 1.0  # CPU pool when --kv-cache-memory is not given (capped by need)
CUDA_KV_FRACTION = 0.9  # of the memory left free after the weights, when not given


class ModelRunner:
    """The model, its KV pool (when the decoding algorithm keeps K/V) and the forward."""

    def __init__(
        self,
        model: DecoderTransformer,
        device: torch.device,
        *,
        kv_slots: int = 0,
        parallel: TensorParallelGroup | None = None,
        cuda_graph: bool = False,
        graph_max_rows: int = 32,
        capture: bool | None = None,
    ) -> None:
        self.model = model.fuse_projections()
        self.device = device
        # Tensor parallelism: this rank's shard (model.tp); on rank 0 also the group whose
        # workers run every forward with it (engine/tensor_parallel.py).
        self.tp = model.tp
        self.parallel = parallel
        if parallel is not None:
            parallel.send((INIT, kv_slots))
        self.pool: KVPool | None = None
        # Fixed-shape decode steps replay static forwards (engine/cuda_graphs.py): CUDA graphs
        # on CUDA (``capture``, default there), the same padded forward uncaptured elsewhere.
        # Not for MoE layers (their expert counts are read on the host mid-forward) nor under
        # tensor parallelism, and only for algorithms that keep K/V.
        graphs = cuda_graph and kv_slots > 0 and model.config.moe is None and self.tp is None
        if kv_slots > 0:
            cfg, weight = model.config, model.embed_tokens.weight
            self.pool = KVPool(
                cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, kv_slots,
                dtype=weight.dtype, device=device, scratch_slots=MAX_Q if graphs else 0,
            )  # fmt: skip
        self.last_batch: FlatBatch | None = None  # for benchmarks replaying forwards
        self._arange = array("q", range(4096))  # positions 0.. as int64, sliced per row
        # The weight view per phase (a tri-mode model's draft-only LoRA; models/lora.py).
        # Eager forwards apply it per token from RowSpec.draft; graph capture, when it comes,
        # must call before_draft / before_verify before capturing or replaying a phase's
        # graph and after_capture afterwards. No-ops without a draft LoRA.
        self.phase_hooks: PhaseHooks = weight_view_hooks(self.model)
        self.graphs: GraphRunner | None = None
        if graphs:
            assert self.pool is not None
            self.graphs = GraphRunner(
                self.model, self.pool, device, self.phase_hooks, max_rows=graph_max_rows,
                capture=device.type == "cuda" if capture is None else capture,
            )  # fmt: skip
        self._cpu_seconds = 0.0
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    @staticmethod
    def pool_slots(
        model: DecoderTransformer,
        device: torch.device,
        memory_gib: float | None,
        max_slots: int,
    ) -> int:
        """Slots a pool of ``memory_gib`` holds (default: see module constants), ≤ max_slots."""
        cfg, weight = model.config, model.embed_tokens.weight
        per_slot = KVPool.bytes_per_slot(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, weight.dtype)
        if memory_gib is not None:
            budget = int(memory_gib * _GIB)
        elif device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(device)
            budget = int(free * CUDA_KV_FRACTION) - _GIB  # headroom for activations
        else:
            budget = int(CPU_DEFAULT_KV_GIB * _GIB)
        return max(0, min(budget // per_slot, max_slots))

    # ---- one step ------------------------------------------------------------------------------
    def build(self, rows: list[RowSpec]) -> tuple[FlatBatch, int]:
        """The flat batch of ``rows`` and ``M`` (logits per row after padding).

        Host cost per row is a few C-level list/array extends (no Python loop per token): this
        runs once per step on the engine thread, between two forwards.
        """
        # Lists grow in C (``list.extend``), positions are slices of a cached int64 range; one
        # conversion to int64 at the end (``array.extend`` from a list costs twice as much).
        ids: list[int] = []
        positions = array("q")
        slots: list[int] = []
        logits_at: list[int] = []
        draft: list[int] = []  # flat tokens in the draft weight view (draft-only LoRA)
        arange = self._arange
        width = max(len(r.logits_at) for r in rows)
        any_kv = rows[0].kv is not None or any(r.kv is not None for r in rows)
        # Group consecutive rows of one shape; the rows arrive sorted by the scheduler.
        groups: list[list] = []  # [start, rows, q_len, causal, cached, bases, prefixes]
        block_rows: dict[int, RowSpec] = {}  # group index → its block-causal row
        last_key: tuple[int, AttentionKind, bool] | None = None
        offset = top = 0
        for row in rows:
            n = len(row.tokens)
            wanted = row.logits_at
            if n == 0 or not wanted:
                raise ValueError("a row needs tokens and at least one requested output")
            ids.extend(row.tokens)
            end = row.start + n
            if end > len(arange):
                arange = self._arange = array("q", range(2 * end))
            positions.extend(arange[row.start : end])
            top = max(top, end)
            kv = row.kv
            if any_kv:
                if kv is None:
                    raise ValueError("rows with and without a KV span cannot share a forward")
                if end > kv.capacity:
                    raise ValueError(f"a row of {end} tokens overflows its KV span")
                slots.extend(range(kv.start + row.start, kv.start + end))
            if row.draft:
                draft.extend(range(offset, offset + n))
            # ``map`` over a bound add runs in C: no Python frame per requested position.
            logits_at.extend(map(offset.__add__, wanted))
            if len(wanted) < width:
                logits_at.extend([offset + wanted[0]] * (width - len(wanted)))
            cached = kv is not None and row.start > 0
            # Rows of one shape and kind share an attention call; a block-causal row is a group
            # of its own (its mask depends on where its blocks fall).
            attention = row.attention
            key = None if attention is AttentionKind.BLOCK_CAUSAL else (n, attention, cached)
            if key is not None and key == last_key:
                groups[-1][1] += 1
            else:
                groups.append([offset, 1, n, attention is AttentionKind.CAUSAL, cached, [], []])
                if key is None:
                    block_rows[len(groups) - 1] = row
            last_key = key
            if cached:
                assert kv is not None
                groups[-1][5].append(kv.start)
                groups[-1][6].append(row.start)
            offset += n
        t = len(ids)
        # One host buffer for every index of the step, one copy to the device. ``array`` holds
        # int64 in C, about 3x faster to fill than ``torch.tensor`` on a list.
        host = array("q", ids)
        host.extend(positions)
        host.extend(array("q", slots + logits_at + draft))
        packed = torch.frombuffer(host, dtype=torch.long)
        if self.device.type != "cpu":
            # The previous step ended with its device→host copy, so the device is idle here
            # and this copy does not wait for it.
            packed = packed.to(self.device)
        input_ids, pos = packed[:t], packed[t : 2 * t]
        slot_mapping = packed[2 * t : 3 * t] if any_kv else None
        index_start = (3 if any_kv else 2) * t
        index = packed[index_start : index_start + len(logits_at)]
        draft_index = packed[index_start + len(logits_at) :] if draft else None
        attn = [
            self._block_causal(g, block_rows[i]) if i in block_rows else self._group(g)
            for i, g in enumerate(groups)
        ]
        batch = FlatBatch(
            input_ids, pos, attn, index, slot_mapping, max_position=top - 1, draft_index=draft_index
        )
        return batch, width

    def _group(self, group: list) -> AttnGroup:
        start, n, q_len, causal, cached, bases, prefixes = group
        if not cached:
            return AttnGroup(start, n, q_len, is_causal=causal)
        # Keys: each row's prefix then its current tokens, gathered from the pool (the masks
        # are built here, once per forward, and shared by every layer).
        longest = max(prefixes) + q_len
        packed = torch.tensor(bases + prefixes, dtype=torch.long).to(self.device)
        first, prefix = packed[:n], packed[n:]
        cols = torch.arange(longest, device=self.device)
        kv_slots = first[:, None] + cols[None, :]
        query = torch.arange(q_len, device=self.device)
        if len(set(prefixes)) == 1:
            mask = None
            if causal:  # lower-right causal: query i sees keys j <= prefix + i ([q_len, S])
                mask = cols[None, :] <= (query + prefixes[0])[:, None]
            return AttnGroup(start, n, q_len, kv_slots=kv_slots, mask=mask)
        # Ragged prefixes: a row's keys past its own (prefix + current tokens) read the pool's
        # zero slot, masked; never another request's slots, whatever they hold.
        assert self.pool is not None
        own = cols[None, :] < (prefix + q_len)[:, None]
        kv_slots = torch.where(own, kv_slots, self.pool.zero_slot)
        if causal:  # key j visible to query i iff j <= prefix + i
            limit = prefix[:, None] + query[None, :]
        else:  # every key of the row: j < prefix + q_len
            limit = (prefix + q_len - 1)[:, None].expand(n, q_len)
        mask = (cols[None, None, :] <= limit[:, :, None])[:, None]
        return AttnGroup(start, n, q_len, kv_slots=kv_slots, mask=mask)

    def _block_causal(self, group: list, row: RowSpec) -> AttnGroup:
        """One block-causal row: query at position p sees key q iff block(q) <= block(p).

        A ``[q_len, start + q_len]`` mask, built once per forward: this is the prefill of a
        block-diffusion prompt (its whole blocks), never a decode step.
        """
        start, n, q_len, _causal, cached, bases, _prefixes = group
        keys = torch.arange(row.start + q_len, device=self.device)
        queries = keys[row.start :]
        mask = (keys[None, :] // row.block) <= (queries[:, None] // row.block)
        if not cached:
            return AttnGroup(start, n, q_len, mask=mask)
        first = torch.tensor(bases, dtype=torch.long).to(self.device)
        return AttnGroup(start, n, q_len, kv_slots=first[:, None] + keys[None, :], mask=mask)

    def run(self, rows: list[RowSpec]) -> torch.Tensor | None:
        """Logits ``[len(rows), M, V]`` for one step (see the module docstring); None on a
        tensor-parallel worker, whose logits go to rank 0."""
        if not torch.is_inference_mode_enabled():
            # The engine thread runs in inference mode already; entering and leaving it costs
            # more than a small step's whole sampler, so only other callers pay for it here.
            with torch.inference_mode():
                return self.run(rows)
        if self.tp is None:
            graphs = self.graphs
            if graphs is not None and (key := graphs.key_for(rows)) is not None:
                static = graphs.static_for(key, rows)
                if static is not None:
                    width = max(len(r.logits_at) for r in rows)
                    return self.forward_graph(static, len(rows), width)
            batch, width = self.build(rows)
            return self.forward(batch).view(len(rows), width, -1)
        try:
            if self.parallel is not None:  # the workers build and run the same batch
                self.parallel.send((RUN, rows))
            batch, width = self.build(rows)
            logits = gather_vocab(self.forward(batch), self.tp)
        except (RuntimeError, OSError) as exc:
            # A collective failed: a rank is gone (or the network between ranks). The group
            # cannot recover mid-step, so the whole server stops, visibly, never hangs: rank 0
            # answers 503 for the group's grace period first; a worker exits at once.
            if self.parallel is not None:
                self.parallel.fail(f"tensor-parallel collective failed: {exc}")
            logger.critical("tensor-parallel collective failed: %s; exiting", exc)
            os._exit(1)
        if logits is None:  # a worker: rank 0 samples
            return None
        return logits.view(len(rows), width, -1)

    def close(self) -> None:
        """Stop the tensor-parallel workers (rank 0; nothing to do otherwise)."""
        if self.parallel is not None:
            self.parallel.stop()

    def forward(self, batch: FlatBatch) -> torch.Tensor:
        """The model and LM head on a built batch: logits ``[N, V]``."""
        self.last_batch = batch
        started = self._timer_start()
        logits = self.model.lm_head(self.model.forward_flat(batch, self.pool))
        self._timer_stop(started)
        return logits

    def forward_graph(self, static: StaticForward, rows: int, width: int) -> torch.Tensor:
        """A filled static forward (a graph replay on CUDA): logits ``[rows, width, V]``."""
        assert self.graphs is not None
        started = self._timer_start()
        logits = self.graphs.run(static, rows, width)
        self._timer_stop(started)
        return logits

    def _timer_start(self) -> float:
        if self.device.type == "cuda":
            # CUDA events time the kernels themselves without a host sync; they are read in
            # :meth:`forward_seconds` after the step's one device→host copy.
            self._events = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
            self._events[0].record()
        return time.perf_counter()

    def _timer_stop(self, started: float) -> None:
        if self.device.type == "cuda":
            assert self._events is not None
            self._events[1].record()
        else:
            self._cpu_seconds = time.perf_counter() - started

    def forward_seconds(self) -> float:
        """Duration of the last forward; on CUDA call it after that step's results were read."""
        if self.device.type == "cuda":
            start, end = self._events
            end.synchronize()  # already complete once the step's results reached the host
            return start.elapsed_time(end) / 1000.0
        return self._cpu_seconds
