"""ModelRunner: owns the device side of serving — the weights, the KV pool and the forward.

``run(rows)`` packs the rows of one step into a :class:`FlatBatch` (real tokens only; one
host→device copy for all of its index tensors) or, for a forward that fits a captured graph,
into that graph's static inputs (``graphs.py``), runs the model and the LM head at the
requested positions only, and returns :class:`StepLogits`: ``[N, V]`` for the ``N`` positions
the rows asked for, no row padded to the widest, with each row's layout. Nothing here reads a
device value back.

**Packing a step's rows** (:class:`BatchPacker`): the host side of the ModelRunner's forward.
Rows (host :class:`RowSpec` lists) become one int64 host buffer — token ids, positions, KV
slots to write, logit positions, draft flags, the logits' layout — copied to the device once,
and the attention plan: with FlexAttention one block mask for the whole forward (its own
host→device copy), with SDPA an :class:`AttnGroup` per run of consecutive rows of one shape
and attention kind, whose key slots and mask are built once per forward and shared by every
layer. This runs once per step on the engine thread, between two forwards, so the host cost
per row is a few C-level list extends, never a Python loop per token.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from array import array
from dataclasses import dataclass, field
from typing import NoReturn

import torch

from dllm_serve.decoding.protocol import AttentionKind, RowSpec, StepLogits, logit_layout
from dllm_serve.engine.graphs import DEFAULT_MAX_TOKENS, GraphRunner, StaticForward
from dllm_serve.engine.parallel.group import TensorParallelGroup, VocabTraffic
from dllm_serve.engine.parallel.vocab import (
    VocabOp,
    VocabShardedLogits,
    apply,
    gather_parts,
    reduce_greedy,
)
from dllm_serve.models.attention import (
    KV_BLOCK,
    AttnGroup,
    FlatBatch,
    FlexPlan,
    PlanBuffers,
    RowAttention,
    RowInput,
    build_plan,
    host_to_device,
    page_slots,
    prefix_keys,
    to_device,
)
from dllm_serve.models.kv_pool import PAGE_SIZE, KVPool
from dllm_serve.models.moe import MoE
from dllm_serve.models.transformer import DecoderTransformer

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
        graph_max_tokens: int = DEFAULT_MAX_TOKENS,
        capture: bool | None = None,
        mask_id: int | None = None,
        attention: str = "sdpa",
    ) -> None:
        self.model = model.fuse_projections()
        self.device = device
        # Tensor parallelism: this rank's shard (model.tp); on rank 0 also the group whose
        # workers run every forward with it (engine/workers.py).
        self.tp = model.tp
        self.parallel = parallel
        # Under tensor parallelism every rank reduces each step's logits greedily with the
        # model's mask id excluded (engine/parallel/vocab.py); rank 0 tells the workers which.
        self.mask_id = mask_id
        if parallel is not None:
            parallel.send((INIT, kv_slots, mask_id, attention))
        self.pool: KVPool | None = None
        # Forwards up to graph_max_tokens replay static forwards (engine/graphs.py): CUDA
        # graphs on CUDA (``capture``, default there), the same padded forward uncaptured
        # elsewhere. They read keys through FlexAttention, so only with that backend and a KV
        # pool; not under tensor parallelism, nor for MoE layers that read expert counts back
        # (the one-by-one expert path).
        moe = [m for m in self.model.modules() if isinstance(m, MoE)]
        graphs = (
            cuda_graph
            and attention == "flex"
            and kv_slots > 0
            and self.tp is None
            and all(m.capturable for m in moe)
            # Block routing reads each forward's row offsets, which a captured forward's
            # static inputs do not carry: a block-routed model runs eagerly.
            and not any(m.cfg.expert_capacity is not None for m in moe)
        )
        if kv_slots > 0:
            cfg, weight = model.config, model.embed_tokens.weight
            self.pool = KVPool(
                cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, kv_slots,
                dtype=weight.dtype, device=device, scratch_slots=PAGE_SIZE if graphs else 0,
            )  # fmt: skip
        self.attention = attention
        # A model whose rows run in different modes (DiffusionGemma's encoder and decoder
        # passes) reads each row's kind and per-row input from the batch.
        row_inputs = bool(getattr(self.model, "needs_row_inputs", False))
        if row_inputs and attention != "sdpa":
            raise ValueError(
                f"{type(self.model).__name__} runs on the sdpa attention backend only "
                f"(--attention-backend sdpa), not {attention!r}"
            )
        self.packer = BatchPacker(
            device, self.pool, attention, pad_logits=self.tp is not None,
            row_pages=-(-model.config.max_sequence_length // PAGE_SIZE),
            row_inputs=row_inputs,
        )  # fmt: skip
        self.last_batch: FlatBatch | None = None  # the last eager batch, for tests to inspect
        self.last_graphed = False  # whether the last run() replayed a static forward
        self.graphs: GraphRunner | None = None
        if graphs:
            assert self.pool is not None
            self.graphs = GraphRunner(
                self.model, self.pool, device, max_tokens=graph_max_tokens,
                capture=device.type == "cuda" if capture is None else capture,
            )  # fmt: skip
            if self.graphs.capture:  # at start-up, not on some request's first step
                self.graphs.capture_all()
        self._cpu_seconds = 0.0
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    @staticmethod
    def pool_slots(
        model: DecoderTransformer,
        device: torch.device,
        memory_gib: float | None,
        max_slots: int,
        reserve: int = 0,
    ) -> int:
        """Slots a pool of ``memory_gib`` holds (default: see module constants, less
        ``reserve`` bytes set aside for the CUDA graphs), ≤ max_slots."""
        cfg, weight = model.config, model.embed_tokens.weight
        per_slot = KVPool.bytes_per_slot(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, weight.dtype)
        if memory_gib is not None:
            budget = int(memory_gib * _GIB)
        elif device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(device)
            budget = int(free * CUDA_KV_FRACTION) - _GIB - reserve  # headroom: activations
        else:
            budget = int(CPU_DEFAULT_KV_GIB * _GIB)
        return max(0, min(budget // per_slot, max_slots))

    # ---- one step ------------------------------------------------------------------------------
    def build(self, rows: list[RowSpec]) -> tuple[FlatBatch, int]:
        """The flat batch of ``rows`` and ``M`` (the most logits any row asked for)."""
        self._take_pages(rows)
        return self.packer.build(rows)

    def _take_pages(self, rows: list[RowSpec]) -> None:
        """Pages for every position the rows write. Rank 0 allocates; under tensor parallelism
        the workers take the page tables as they come with the rows, so their pools stay in
        step."""
        pool = self.pool
        if pool is not None and (self.tp is None or self.tp.rank == 0):
            for row in rows:
                if row.kv is not None:
                    pool.grow(row.kv, row.start + len(row.tokens))

    def run(
        self, rows: list[RowSpec], copies: list[tuple[list[int], list[int]]] | None = None
    ) -> StepLogits | torch.Tensor:
        """One step's logits at the requested positions (see the module docstring). Under
        tensor parallelism each rank's vocabulary slice: rank 0 gets it wrapped as sharded
        logits (its sampler's reductions reach the other ranks), a worker the bare slice."""
        if not torch.is_inference_mode_enabled():
            # The engine thread runs in inference mode already; entering and leaving it costs
            # more than a small step's whole sampler, so only other callers pay for it here.
            with torch.inference_mode():
                return self.run(rows, copies)
        self._take_pages(rows)  # before the rows go to the workers or into a graph
        if self.pool is not None:
            # Prefix-cache hits copied into their requests' pages (the flex backend), before
            # this forward reads them: rank 0's queue, a worker's from the RUN message.
            if copies is None and (self.tp is None or self.tp.rank == 0):
                copies = self.pool.take_copies()
            self.pool.apply_copies(copies or [])
        self.last_graphed = False
        if self.tp is None:
            graphs = self.graphs
            if graphs is not None and (key := graphs.key_for(rows)) is not None:
                static = graphs.static_for(key)
                if static is not None:
                    counts, offsets, layout = self.packer.fill(static, rows)
                    logits = self.forward_graph(static)[: sum(counts)]
                    self.last_graphed = True
                    return StepLogits(logits, counts, offsets, layout)
            batch, _ = self.build(rows)
            return self.step_logits(batch, self.forward(batch))
        try:
            if self.parallel is not None:  # the workers build and run the same batch
                self.parallel.send((RUN, [_portable(row) for row in rows], copies))
            batch, width = self.build(rows)
            local = self.forward(batch).view(len(rows), width, -1)
            if self.tp.rank != 0:  # a worker: its greedy part, then keep the slice for more
                if self.mask_id is not None:
                    reduce_greedy(local, self.tp, self.mask_id)
                return local
            # Rank 0 samples the sharded logits without gathering them (parallel/vocab.py).
            traffic = self.parallel.traffic if self.parallel is not None else VocabTraffic()
            logits = VocabShardedLogits(
                local, self.tp, self.parallel, traffic=traffic,
                embedding_product=getattr(self.model, "soft_product", None),
            )  # fmt: skip
            if self.mask_id is not None:
                logits = logits.take_greedy(self.mask_id)
            return StepLogits.padded(logits)
        except (RuntimeError, OSError) as exc:
            self._collective_failed(exc)

    def reduce(self, op: VocabOp, local: torch.Tensor) -> None:
        """A worker's part of one of rank 0's sampler reductions of the step's logits."""
        try:
            product = getattr(self.model, "soft_product", None)
            gather_parts(apply(op, local, self.tp, soft_product=product), self.tp)
        except (RuntimeError, OSError) as exc:
            self._collective_failed(exc)

    def _collective_failed(self, exc: BaseException) -> NoReturn:
        # A collective failed: a rank is gone (or the network between ranks). The group
        # cannot recover mid-step, so the whole server stops, visibly, never hangs: rank 0
        # answers 503 for the group's grace period first; a worker exits at once. An out-of-
        # memory error lands here too (the peers would wait for this rank's collective), and
        # is named as such so that nobody looks for a network fault.
        oom = isinstance(exc, torch.OutOfMemoryError)
        what = "step ran out of memory" if oom else "collective failed"
        if self.parallel is not None:
            self.parallel.fail(f"tensor-parallel {what}: {exc}")
        logger.critical("tensor-parallel %s: %s; exiting", what, exc)
        os._exit(1)

    def close(self) -> None:
        """Stop the tensor-parallel workers (rank 0; nothing to do otherwise)."""
        if self.parallel is not None:
            self.parallel.stop()

    @staticmethod
    def step_logits(batch: FlatBatch, logits: torch.Tensor) -> StepLogits:
        """The LM head's output for ``batch`` with its layout per row."""
        if batch.logit_layout is None:  # padded per row already (tensor parallelism)
            return StepLogits.padded(logits.view(len(batch.logit_counts), -1, logits.shape[-1]))
        return StepLogits(logits, batch.logit_counts, batch.logit_offsets, batch.logit_layout)

    def forward(self, batch: FlatBatch) -> torch.Tensor:
        """The model and LM head on a built batch: logits ``[N, V]`` at its requested
        positions."""
        self.last_batch = batch
        started = self._timer_start()
        logits = self.model.lm_head(self.model.forward_flat(batch, self.pool))
        self._timer_stop(started)
        return logits

    def forward_graph(self, static: StaticForward) -> torch.Tensor:
        """A filled static forward (a graph replay on CUDA): logits ``[key.logits, V]``, the
        step's requested positions first."""
        assert self.graphs is not None
        started = self._timer_start()
        logits = self.graphs.run(static)
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


# ---- packing a step's rows ---------------------------------------------------------------------


@dataclass(slots=True)
class _Group:
    """Consecutive rows sharing one attention call, as the packer collects them."""

    start: int  # first flat token
    q_len: int
    causal: bool
    cached: bool  # the rows read a cached prefix from the KV pool
    rows: int = 1
    tables: list[list[int]] = field(default_factory=list)  # each row's pages (cached groups)
    prefixes: list[int] = field(default_factory=list)  # each row's cached prefix length


@dataclass(slots=True)
class _Step:
    """One step's rows as host lists, before they go to the device."""

    ids: list[int]
    positions: array
    slots: list[int]
    logits_at: list[int]
    counts: list[int]  # logit positions per row
    drafts: list[tuple[int, int]]  # (first flat token, tokens) of each draft row
    flex_rows: list[RowAttention]
    groups: list[_Group]
    block_rows: dict[int, RowSpec]  # group index → its block-causal row
    top: int  # the largest position + 1
    any_kv: bool
    row_inputs: list[RowInput] | None = None
    offsets: list[int] = field(default_factory=list)  # each row's first flat token

    def draft_flags(self, length: int) -> list[int]:
        """1 for each flat token in the draft weight view, 0 else; ``length`` tokens."""
        flags = [0] * length
        for start, n in self.drafts:
            flags[start : start + n] = [1] * n
        return flags


class BatchPacker:
    """Builds the :class:`FlatBatch` of a step's rows on ``device``, or fills a static
    forward's inputs with them."""

    def __init__(
        self,
        device: torch.device,
        pool: KVPool | None,
        attention: str = "sdpa",
        pad_logits: bool = False,
        row_pages: int = 0,
        row_inputs: bool = False,
    ) -> None:
        if attention not in ("flex", "sdpa"):
            raise ValueError(f"attention backend {attention!r}: flex or sdpa")
        self.device = device
        self.pool = pool
        self.flex = attention == "flex"
        # Logit positions padded per row to the widest (tensor parallelism's vocab-parallel
        # sampler works on [R, M] rows); else only the positions asked for (the LM head and
        # the sampler's softmax then never run on padding).
        self.pad_logits = pad_logits
        self.row_pages = row_pages  # the most KV pages one row may read (the model's context)
        self.row_inputs = row_inputs  # FlatBatch.row_inputs for models that read them
        self._arange = array("q", range(4096))  # positions 0.. as int64, sliced per row

    def _collect(self, rows: list[RowSpec]) -> _Step:
        """The host lists of ``rows``. Lists grow in C (``list.extend``), positions are slices
        of a cached int64 range, so the host cost per row is a few C-level calls, never a
        Python loop per token."""
        ids: list[int] = []
        positions = array("q")
        slots: list[int] = []
        logits_at: list[int] = []
        drafts: list[tuple[int, int]] = []
        arange = self._arange
        width = max(len(r.logits_at) for r in rows)
        any_kv = any(r.kv is not None for r in rows)
        # Group consecutive rows of one shape (SDPA); the rows arrive sorted by the scheduler.
        groups: list[_Group] = []
        block_rows: dict[int, RowSpec] = {}
        last_key: tuple[int, AttentionKind, bool] | None = None
        offset = top = 0
        flex_rows: list[RowAttention] = []
        counts: list[int] = []
        pad = self.pad_logits
        inputs: list[RowInput] | None = [] if self.row_inputs else None
        row_offsets: list[int] = []
        for row in rows:
            row.check()
            row_offsets.append(offset)
            n = len(row.tokens)
            wanted = row.logits_at
            ids.extend(row.tokens)
            end = row.start + n
            if end > len(arange):
                arange = self._arange = array("q", range(2 * end))
            positions.extend(arange[row.start : end])
            top = max(top, end)
            kv = row.kv
            if any_kv:
                if kv is None:
                    raise ValueError("rows with and without a KV cache cannot share a forward")
                if end > len(kv.pages) * kv.page_size:
                    raise ValueError(f"a row of {end} tokens has pages for fewer")
                slots.extend(kv.slots(row.start, end))
            if row.draft:
                drafts.append((offset, n))
            if inputs is not None:
                causal = row.attention is AttentionKind.CAUSAL
                inputs.append(RowInput(offset, n, row.start, causal, row.model_input))
            if self.flex:
                flex_rows.append(_row_attention(row, offset))
            # ``map`` over a bound add runs in C: no Python frame per requested position.
            logits_at.extend(map(offset.__add__, wanted))
            counts.append(len(wanted))
            if pad and len(wanted) < width:
                logits_at.extend([offset + wanted[0]] * (width - len(wanted)))
            if not self.flex:
                cached = kv is not None and row.start > 0
                # Rows of one shape and kind share an attention call; a block-causal row is a
                # group of its own (its mask depends on where its blocks fall).
                attention = row.attention
                key = None if attention is AttentionKind.BLOCK_CAUSAL else (n, attention, cached)
                if key is not None and key == last_key:
                    groups[-1].rows += 1
                else:
                    groups.append(_Group(offset, n, attention is AttentionKind.CAUSAL, cached))
                    if key is None:
                        block_rows[len(groups) - 1] = row
                last_key = key
                if kv is not None and (cached or key is None):
                    groups[-1].tables.append(kv.pages)
                    groups[-1].prefixes.append(row.start)
            offset += n
        return _Step(
            ids, positions, slots, logits_at, counts, drafts, flex_rows, groups, block_rows,
            top, any_kv, inputs, row_offsets,
        )  # fmt: skip

    def _plan(self, step: _Step, buffers: PlanBuffers | None = None) -> FlexPlan:
        pool = self.pool if step.any_kv else None
        released: list[int] = []
        if pool is not None:
            released, pool.released = pool.released, []
        return build_plan(
            step.flex_rows,
            kv_length=pool.k.shape[1] if pool is not None else len(step.ids),
            device=self.device,
            page_owner=pool.page_owner if pool is not None else None,
            page_index=pool.page_index if pool is not None else None,
            page_size=pool.page_size if pool is not None else KV_BLOCK,
            row_pages=self.row_pages,
            released=released,
            buffers=buffers,
        )

    def build(self, rows: list[RowSpec]) -> tuple[FlatBatch, int]:
        """The flat batch of ``rows`` and ``M`` (logits per row after padding)."""
        step = self._collect(rows)
        t = len(step.ids)
        width = max(step.counts)
        pad = self.pad_logits
        offsets, layout = ([], []) if pad else logit_layout(step.counts)
        draft = step.draft_flags(t) if step.drafts else []
        # One host buffer for every index of the step, one copy to the device.
        host = array("q", step.ids)
        host.extend(step.positions)
        host.extend(array("q", step.slots + step.logits_at + draft + layout + step.offsets))
        # Pinned and non-blocking on CUDA (attention.staged): the host goes on to launch the
        # forward while it copies.
        packed = host_to_device(torch.frombuffer(host, dtype=torch.long), self.device)
        input_ids, pos = packed[:t], packed[t : 2 * t]
        slot_mapping = packed[2 * t : 3 * t] if step.any_kv else None
        index_start = (3 if step.any_kv else 2) * t
        n = len(step.logits_at)
        index = packed[index_start : index_start + n]
        draft_start = index_start + n
        draft_mask = packed[draft_start : draft_start + t].bool() if draft else None
        layout_index = None
        layout_start = draft_start + len(draft)
        if not pad:
            layout_index = packed[layout_start : layout_start + len(layout)].view(len(rows), width)
        row_offsets = packed[layout_start + len(layout) :]
        shape = {
            "logit_counts": step.counts,
            "logit_offsets": offsets,
            "logit_layout": layout_index,
        }
        plan = self._plan(step) if self.flex else None
        groups = []
        if plan is None:
            groups = [
                self._block_causal(g, step.block_rows[i]) if i in step.block_rows
                else self._group(g)
                for i, g in enumerate(step.groups)
            ]  # fmt: skip
        batch = FlatBatch(
            input_ids, pos, groups, index, slot_mapping, max_position=step.top - 1,
            draft=draft_mask, flex=plan, row_inputs=step.row_inputs, row_offsets=row_offsets,
            **shape,
        )  # fmt: skip
        return batch, width

    def fill(
        self, static: StaticForward, rows: list[RowSpec]
    ) -> tuple[list[int], list[int], torch.Tensor]:
        """Write ``rows`` into a static forward's inputs and plan buffers, padded to its key;
        each row's logit count and offset, and the ``[R, M]`` layout of its logits."""
        step = self._collect(rows)
        assert self.pool is not None and step.any_kv and not self.pad_logits
        key = static.key
        t, n = len(step.ids), len(step.logits_at)
        pad = key.tokens - t
        offsets, layout = logit_layout(step.counts)
        host = array("q", step.ids)
        host.extend([0] * pad)
        host.extend(step.positions)
        host.extend([0] * pad)
        tail = step.slots + [self.pool.scratch_start] * pad  # padding writes scratch only
        tail += step.logits_at + [0] * (key.logits - n)
        if static.drafts:
            tail += step.draft_flags(key.tokens)
        size = len(host) + len(tail)
        host.extend(array("q", tail + layout))
        packed = host_to_device(torch.frombuffer(host, dtype=torch.long), self.device)
        static.inputs.copy_(packed[:size])
        self._plan(step, static.buffers)
        return step.counts, offsets, packed[size:].view(len(rows), max(step.counts))

    def _group(self, g: _Group) -> AttnGroup:
        if not g.cached:
            return AttnGroup(g.start, g.rows, g.q_len, is_causal=g.causal)
        # Keys: each row's prefix then its current tokens, gathered from the pool.
        pool = self.pool
        assert pool is not None
        longest = max(g.prefixes) + g.q_len
        table, prefix = self._tables(g, pool.pages_for(longest), pool.zero_page)
        cols = torch.arange(longest, device=self.device)
        query = torch.arange(g.q_len, device=self.device)
        if len(set(g.prefixes)) == 1:
            mask = None
            if g.causal:  # lower-right causal: query i sees keys j <= prefix + i ([q_len, S])
                mask = cols[None, :] <= (query + g.prefixes[0])[:, None]
            kv_slots = page_slots(table, cols, pool.page_size)
            return AttnGroup(g.start, g.rows, g.q_len, kv_slots=kv_slots, mask=mask)
        kv_slots, mask = prefix_keys(
            table, prefix, cols, query, g.causal, pool.zero_slot, pool.page_size
        )
        return AttnGroup(g.start, g.rows, g.q_len, kv_slots=kv_slots, mask=mask)

    def _tables(self, g: _Group, width: int, fill: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's page tables ``[rows, width]`` (past a row's pages: ``fill``) and its
        rows' prefix lengths ``[rows]``, in one host→device copy."""
        flat: list[int] = []
        for pages in g.tables:
            flat.extend(pages[:width])
            flat.extend([fill] * (width - min(width, len(pages))))
        flat.extend(g.prefixes)
        packed = to_device(flat, self.device, torch.long)
        rows = len(g.tables)
        return packed[: rows * width].view(rows, width), packed[rows * width :]

    def _block_causal(self, g: _Group, row: RowSpec) -> AttnGroup:
        """One block-causal row: query at position p sees key q iff block(q) <= block(p).

        A ``[q_len, start + q_len]`` mask, built once per forward: this is the prefill of a
        block-diffusion prompt (its whole blocks), never a decode step.
        """
        keys = torch.arange(row.start + g.q_len, device=self.device)
        queries = keys[row.start :]
        mask = (keys[None, :] // row.block) <= (queries[:, None] // row.block)
        if not g.cached:
            return AttnGroup(g.start, g.rows, g.q_len, mask=mask)
        pool = self.pool
        assert pool is not None
        table, _ = self._tables(g, pool.pages_for(keys.shape[0]), pool.zero_page)
        kv_slots = page_slots(table, keys, pool.page_size)
        return AttnGroup(g.start, g.rows, g.q_len, kv_slots=kv_slots, mask=mask)


def _portable(row: RowSpec) -> RowSpec:
    """``row`` as it is sent to the workers: a device ``model_input`` (DiffusionGemma's
    self-conditioning signal, ``[C, d_model]``) travels in the pickled message through the
    host (each worker's model moves it to its own device); a CUDA tensor pickled as it is
    would be rebuilt on rank 0's device."""
    value = row.model_input
    if isinstance(value, torch.Tensor) and value.device.type != "cpu":
        return dataclasses.replace(row, model_input=value.cpu())
    return row


def _row_attention(row: RowSpec, offset: int) -> RowAttention:
    """The interval of keys each query of ``row`` sees (FlexAttention): positions in the
    request's context with a KV cache, flat-token indices of the row's own segment without."""
    n, start = len(row.tokens), row.start
    kv = row.kv
    base = 0 if kv is not None else offset - start  # key index of position 0
    lo = [base] * n
    kind = row.attention
    if kind is AttentionKind.CAUSAL:
        hi = list(range(base + start + 1, base + start + n + 1))
    elif kind is AttentionKind.BLOCK_CAUSAL:
        # A query sees up to the end of its own block (blocks aligned to position 0), and
        # no key past the row's own tokens (a last block the row does not fill).
        b, hi = row.block, []
        position = start
        while position < start + n:
            end = min(start + n, (position // b + 1) * b)
            hi.extend([base + end] * (end - position))
            position = end
    else:
        hi = [base + start + n] * n
    if kv is None:
        return RowAttention(offset, n, lo, hi)
    return RowAttention(offset, n, lo, hi, owner=kv.id, pages=kv.pages)
