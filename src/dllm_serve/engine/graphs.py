"""Captured forwards for the fixed-shape steps: one CUDA graph per phase and shape bucket.

A decode step of a diffusion model has the shape a captured graph serves best: every row
forwards the same number ``q`` of tokens (a block, an I-DLM round of ``2N − 1``) against its
own cached prefix in the KV pool. Such a step is launch-bound on a GPU — a forward of an 8B
model is ~1,000 kernels — so it is captured once and replayed: LLaDA's cached block steps
(prefix cache), I-DLM / LinearSpec / ``ar`` rounds, and block-diffusion decode steps (SDAR,
LLaDA2's dense layers, Fast-dLLM v2). Prefills, refresh steps, block-causal writes and mixed
batches are not fixed-shape and run eagerly, as do MoE models (their grouped expert GEMMs are
not yet checked under capture on a GPU, and their fallback reads counts on the host) and
tensor-parallel ranks.

A graph is keyed by :class:`GraphKey`: the batch rounded up to a bucket of rows, ``q``, the
attention kind, the keys per row rounded up to ``CONTEXT_QUANTUM`` and the logits per row
rounded up to a power of two, and the phase's weight view (``draft``). Its inputs are static
tensors filled by one host→device copy per step: token ids, positions, KV slots to write,
logit positions, and each row's page table and prefix length — the key slots and the
attention mask (``[rows, 1, q, S]``: a row sees its prefix and, causal or not, its own tokens)
are computed *inside* the graph from the last two, so no ``[L, L]`` tensor is ever built on
the host. Rows of the bucket past the real ones are padding: token 0 at positions ``0..q−1``,
writing and reading their K/V in the pool's scratch pages, never a request's.

Phases (:class:`~dllm_serve.models.lora.PhaseHooks`): a graph of draft rows is captured and
replayed with the draft weight view set (``before_draft``), any other with the base view
(``before_verify``); ``after_graph`` restores the eager state after either.

On CPU the same static forward runs without capture (``capture=False``): the padded forward
is then the code path a GPU replays, and tests compare its tokens with the eager forward's.
"""

from __future__ import annotations

import logging
from array import array
from dataclasses import dataclass

import torch

from dllm_serve.decoding.protocol import AttentionKind, RowSpec
from dllm_serve.models.attention import AttnGroup, FlatBatch, prefix_keys, staged
from dllm_serve.models.errors import is_device_fault
from dllm_serve.models.kv_pool import KVPool
from dllm_serve.models.lora import PhaseHooks
from dllm_serve.models.transformer import DecoderTransformer

logger = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
CONTEXT_QUANTUM = 256  # keys per row are padded to a multiple of this
MAX_Q = 64  # tokens per row of a graphed step (scratch slots for padding rows)
MAX_GRAPHS = 64  # past this many shapes, new ones run eagerly (each graph holds memory)


def bucket(n: int, buckets: tuple[int, ...] = ROW_BUCKETS) -> int | None:
    """The smallest bucket ≥ ``n``, or None past the largest."""
    return next((b for b in buckets if b >= n), None)


@dataclass(frozen=True, slots=True)
class GraphKey:
    """The shape and phase of one captured forward."""

    rows: int  # batch bucket (real rows ≤ it; the rest are padding)
    q_len: int  # tokens per row
    causal: bool
    context: int  # keys per row (prefix + q, rounded up)
    width: int  # logits per row (a power of two ≥ the widest row's)
    draft: bool  # the draft weight view (a tri-mode model's LoRA) or the base one


def graph_key(rows: list[RowSpec], max_rows: int, max_context: int) -> GraphKey | None:
    """The key of a step whose rows can replay a graph, or None (it runs eagerly)."""
    first = rows[0]
    q = len(first.tokens)
    if q == 0 or q > MAX_Q or first.attention is AttentionKind.BLOCK_CAUSAL:
        return None
    longest = width = 0
    for row in rows:
        if (
            row.kv is None
            or row.start == 0  # a prefill or refresh: no cached prefix, not a decode step
            or len(row.tokens) != q
            or row.attention is not first.attention
            or row.draft != first.draft
        ):
            return None
        longest = max(longest, row.start + q)
        width = max(width, len(row.logits_at))
    n = bucket(len(rows))
    context = -(-longest // CONTEXT_QUANTUM) * CONTEXT_QUANTUM
    if n is None or n > max_rows or context > max_context:
        return None
    return GraphKey(n, q, first.causal, context, 1 << (width - 1).bit_length(), first.draft)


class StaticForward:
    """One graph: its static inputs, its output and, on CUDA, the captured graph."""

    def __init__(
        self, key: GraphKey, model: DecoderTransformer, pool: KVPool, device: torch.device
    ) -> None:
        self.key = key
        self.model = model
        self.pool = pool
        b, q, w = key.rows, key.q_len, key.width
        self.pages = pool.pages_for(key.context)  # page-table entries per row
        p = self.pages
        # One int64 buffer for every per-step input: a single host→device copy fills it.
        self.inputs = torch.zeros(3 * b * q + b * w + b * p + b, dtype=torch.long, device=device)
        views = self.inputs.split([b * q, b * q, b * q, b * w, b * p, b])
        self.input_ids, self.positions, self.slot_mapping, self.logits_index = views[:4]
        self.table, self.prefix = views[4].view(b, p), views[5]
        self.cols = torch.arange(key.context, device=device)
        self.query = torch.arange(q, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: torch.Tensor | None = None
        # Padding rows: positions 0..q-1 in the scratch pages, prefix 0 (they see only
        # themselves); the same for every padding row (their K/V are never read by anyone).
        scratch = pool.scratch_start
        first = scratch // pool.page_size
        used = pool.pages_for(q)
        table = [first + i for i in range(used)] + [pool.zero_page] * (p - used)
        self._pad_row = ([0] * q, list(range(q)), list(range(scratch, scratch + q)), table)

    def fill(self, rows: list[RowSpec]) -> None:
        """Write this step's rows into the static inputs (one host→device copy)."""
        key, q = self.key, self.key.q_len
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        index: list[int] = []
        tables: list[int] = []
        prefixes: list[int] = []
        p, zero_page = self.pages, self.pool.zero_page
        for r, row in enumerate(rows):
            kv = row.kv
            assert kv is not None
            ids.extend(row.tokens)
            positions.extend(range(row.start, row.start + q))
            slots.extend(kv.slots(row.start, row.start + q))
            offset = r * q
            index.extend(map(offset.__add__, row.logits_at))
            # Past a row's own outputs, repeat its first (as the eager runner pads).
            index.extend([offset + row.logits_at[0]] * (key.width - len(row.logits_at)))
            tables.extend(kv.pages[:p])
            tables.extend([zero_page] * (p - min(p, len(kv.pages))))
            prefixes.append(row.start)
        padding = key.rows - len(rows)
        pad_ids, pad_positions, pad_slots, pad_table = self._pad_row
        ids.extend(pad_ids * padding)
        positions.extend(pad_positions * padding)
        slots.extend(pad_slots * padding)
        index.extend([0] * (key.width * padding))
        tables.extend(pad_table * padding)
        prefixes.extend([0] * padding)
        host = torch.frombuffer(
            array("q", ids + positions + slots + index + tables + prefixes), dtype=torch.long
        )
        self.inputs.copy_(staged(host, self.inputs.device), non_blocking=True)

    def forward(self) -> torch.Tensor:
        """The padded forward over the static inputs: logits ``[rows·width, V]``."""
        key = self.key
        pool = self.pool
        kv_slots, mask = prefix_keys(
            self.table, self.prefix, self.cols, self.query, key.causal, pool.zero_slot,
            pool.page_size,
        )  # fmt: skip
        group = AttnGroup(0, key.rows, key.q_len, kv_slots=kv_slots, mask=mask)
        batch = FlatBatch(
            self.input_ids,
            self.positions,
            [group],
            self.logits_index,
            self.slot_mapping,
            max_position=key.context - 1,  # the rope table then covers every replay
        )
        return self.model.lm_head(self.model.forward_flat(batch, self.pool))

    def capture(self, pool_handle: object) -> None:
        """Warm up on a side stream (lazy cuBLAS/attention set-up), then capture."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.forward()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: only this (the engine) thread's CUDA calls are checked during capture.
        with torch.cuda.graph(self.graph, pool=pool_handle, capture_error_mode="thread_local"):
            self.output = self.forward()

    def replay(self) -> torch.Tensor:
        """Run the forward over the current static inputs (the captured graph on CUDA)."""
        if self.graph is None:
            self.output = self.forward()
        else:
            self.graph.replay()
        assert self.output is not None
        return self.output


class GraphRunner:
    """The static forwards of one ModelRunner, captured lazily on a shape's first step.

    ``capture``: record CUDA graphs (CUDA only); False runs the same padded static forward
    eagerly, which is what the CPU tests exercise.
    """

    def __init__(
        self,
        model: DecoderTransformer,
        pool: KVPool,
        device: torch.device,
        hooks: PhaseHooks,
        *,
        max_rows: int,
        capture: bool,
    ) -> None:
        if pool.scratch_slots < MAX_Q:
            raise ValueError(f"graphed steps need {MAX_Q} scratch slots in the KV pool")
        if capture and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model = model
        self.pool = pool
        self.device = device
        self.hooks = hooks
        self.max_rows = max_rows
        self.capture = capture
        # Keys never reach past the rope table built here; a graph reads that table's memory,
        # which the graph itself does not keep alive, so a reference is held here in case a
        # later, longer eager forward replaces the model's table with a bigger one.
        self.max_context = (model.config.max_sequence_length // CONTEXT_QUANTUM) * CONTEXT_QUANTUM
        model.rope(torch.zeros(1, dtype=torch.long, device=device), self.max_context)
        self._rope_tables = list(model._rope_tables.values())
        self.graphs: dict[GraphKey, StaticForward] = {}
        # Shapes whose capture failed run eagerly from then on: a capture is never retried.
        self.failed: set[GraphKey] = set()
        self._pool_handle = torch.cuda.graph_pool_handle() if capture else None
        self._full_logged = False
        self.replays = 0  # steps served by a static forward (tests, benchmarks)

    def key_for(self, rows: list[RowSpec]) -> GraphKey | None:
        return graph_key(rows, self.max_rows, self.max_context)

    def static_for(self, key: GraphKey, rows: list[RowSpec]) -> StaticForward | None:
        """The filled static forward of ``key`` (captured now if new), or None when the cache
        of shapes is full or this shape failed to capture (the step then runs eagerly)."""
        if key in self.failed:
            return None
        static = self.graphs.get(key)
        if static is None:
            if len(self.graphs) >= MAX_GRAPHS:
                if not self._full_logged:
                    logger.warning("%d graph shapes captured; new shapes run eagerly", MAX_GRAPHS)
                    self._full_logged = True
                return None
            static = StaticForward(key, self.model, self.pool, self.device)
            static.fill(rows)  # capture's warm-up runs on this step's real rows
            if self.capture:
                self._phase(key)
                try:
                    static.capture(self._pool_handle)
                except Exception as exc:
                    if is_device_fault(exc):
                        raise  # the device itself failed: not a shape to run eagerly
                    self.failed.add(key)
                    logger.warning(
                        "capturing the graph of %s failed (%s: %s); that shape runs eagerly",
                        key, type(exc).__name__, exc,
                    )  # fmt: skip
                    return None
                finally:
                    self.hooks.after_graph()
            self.graphs[key] = static
            return static
        static.fill(rows)
        return static

    def run(self, static: StaticForward, rows: int, width: int) -> torch.Tensor:
        """Replay ``static`` in its phase's weight view: logits ``[rows, width, V]``."""
        self._phase(static.key)
        try:
            out = static.replay()
        finally:
            self.hooks.after_graph()
        self.replays += 1
        key = static.key
        logits = out.view(key.rows, key.width, -1)[:rows, :width]
        # The decoders consume their logits in place: hand them their own contiguous copy
        # unless the view already is one (then the next replay overwrites it, after use).
        return logits if width == key.width else logits.contiguous()

    def _phase(self, key: GraphKey) -> None:
        (self.hooks.before_draft if key.draft else self.hooks.before_verify)()
