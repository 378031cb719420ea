"""Captured forwards for mixed traffic: one CUDA graph per bucket of tokens and of logits.

A step of a diffusion model at serving batch sizes is launch-bound on a GPU (a forward of an
8B model is ~1,000 kernels), so it is captured once and replayed. With FlexAttention
(``models/attention.py``) the shape of a forward is only its token count and its count of
requested logits: which rows it holds — an I-DLM round of ``2N − 1`` tokens beside one of
``N``, a block-causal K/V write beside a block step, LinearSpec draft rows beside verify rows,
cached prefixes of any length — is data (each query's owner and key interval, each query
block's KV pages, each token's draft flag), written into the graph's static inputs. So a graph
is keyed by :class:`GraphKey` — the tokens padded to a bucket (``attention.BUCKETS``) and the
logits rounded up to a power of two — and one graph serves any mix of rows that fits it.

Static inputs: token ids, positions, the KV slots to write, the logit positions and the draft
flags (one int64 buffer), and the plan's buffers (:class:`~dllm_serve.models.attention.
PlanBuffers`). The output is the first rows of one logits buffer shared by every graph (only
one graph's logits are alive at a time: a step samples them before the next forward). Tokens
past a step's real ones are padding: token 0 at position 0, writing K/V to the pool's scratch
page, owned by no one, so their queries see nothing and no query sees them; padding logits are
never read.

Not graphed (eager): forwards without a KV cache (LLaDA and Dream without ``--kv-cache
prefix``: whole-canvas forwards), forwards of more than ``--cuda-graph-max-tokens`` tokens
(compute-bound: a graph saves little there), models whose MoE layers read expert counts back
(the one-by-one expert path), tensor-parallel ranks, and the SDPA backend.

Capture happens at start-up for every key up to the token limit (:meth:`GraphRunner.
capture_all`: the warm-up compiles the flex kernel of each padded length), after the KV pool
was sized less a reserve for the graphs (:func:`graph_memory`). A key not captured then is
captured on its first step; a shape that fails to capture runs eagerly from then on (logged
once, counted in ``failed``) and is never retried.

On CPU the same static forward runs without capture (``capture=False``): the padded forward
is then the code path a GPU replays, and tests compare its tokens with the eager forward's.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from dllm_serve.decoding.protocol import RowSpec
from dllm_serve.models.attention import (
    BUCKETS,
    KV_BLOCK,
    FlatBatch,
    PlanBuffers,
    mask_width,
    padded_length,
)
from dllm_serve.models.errors import is_device_fault
from dllm_serve.models.kv_pool import KVPool
from dllm_serve.models.transformer import DecoderTransformer
from dllm_serve.models.transformer_config import TransformerConfig

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 1024  # --cuda-graph-max-tokens: 16 rows of a 32-token block and its K/V write
MIN_LOGITS = 16  # the smallest logits bucket


def logits_bucket(n: int) -> int:
    """The power of two ≥ ``n`` (at least ``MIN_LOGITS``) a graph's LM head runs on."""
    return max(MIN_LOGITS, 1 << (max(n, 1) - 1).bit_length())


@dataclass(frozen=True, slots=True)
class GraphKey:
    """The shape of one captured forward."""

    tokens: int  # query tokens, padded (a FlexAttention bucket)
    logits: int  # LM-head rows (a power of two ≤ tokens)


def graph_keys(max_tokens: int) -> list[GraphKey]:
    """Every key up to ``max_tokens`` tokens: what start-up captures."""
    keys = []
    for tokens in BUCKETS:
        if tokens > max_tokens:
            break
        logits = MIN_LOGITS
        while logits <= tokens:
            keys.append(GraphKey(tokens, logits))
            logits *= 2
    return keys


def graph_memory(config: TransformerConfig, max_tokens: int, itemsize: int) -> int:
    """Bytes set aside for the graphs before the KV pool takes its share (an estimate): the
    shared logits buffer, and the activations of the largest graph — its private memory pool
    is shared by every graph, which replay one at a time — at two live layers' worth of every
    intermediate (hidden states, q/k/v, attention output, the MLP's or the routed experts'
    hidden rows)."""
    cfg = config
    mlp = cfg.mlp_hidden_size
    if cfg.moe is not None:
        mlp = max(mlp, cfg.moe.top_k * cfg.moe.expert_hidden_size + cfg.moe.shared_hidden_size)
    per_token = 4 * cfg.d_model + 2 * (cfg.n_heads + cfg.n_kv_heads) * cfg.head_dim + 3 * mlp
    return itemsize * max_tokens * (cfg.vocab_size + 2 * per_token)


class StaticForward:
    """One graph: its static inputs, its plan buffers, its output and, on CUDA, the graph."""

    def __init__(
        self,
        key: GraphKey,
        model: DecoderTransformer,
        pool: KVPool,
        device: torch.device,
        *,
        max_context: int,
        logits: torch.Tensor,
    ) -> None:
        self.key = key
        self.model = model
        self.pool = pool
        self.max_context = max_context
        t, n = key.tokens, key.logits
        self.drafts = any(layer.attn.draft_lora is not None for layer in model.layers)
        sizes = [t, t, t, n] + ([t] if self.drafts else [])
        # One int64 buffer for every per-token input: a single copy fills it.
        self.inputs = torch.zeros(sum(sizes), dtype=torch.long, device=device)
        views = self.inputs.split(sizes)
        self.input_ids, self.positions, self.slot_mapping, self.logits_index = views[:4]
        self.draft_flags = views[4] if self.drafts else None
        # Until a step fills real rows, every token is padding: it writes the scratch page.
        self.slot_mapping.fill_(pool.scratch_start)
        kv_length = pool.k.shape[1]
        row_pages = pool.pages_for(max_context)
        width = mask_width(t, -(-kv_length // KV_BLOCK), row_pages, device)
        self.buffers = PlanBuffers(
            t, kv_length, width, pool.page_owner, pool.page_index, pool.page_size, device
        )
        self.output = logits[:n]
        self.graph: torch.cuda.CUDAGraph | None = None

    def forward(self) -> torch.Tensor:
        """The padded forward over the static inputs: logits ``[key.logits, V]``."""
        draft = None if self.draft_flags is None else self.draft_flags.bool()
        batch = FlatBatch(
            self.input_ids,
            self.positions,
            [],
            self.logits_index,
            self.slot_mapping,
            max_position=self.max_context - 1,  # the rope table then covers every replay
            draft=draft,
            flex=self.buffers.plan,
        )
        hidden = self.model.forward_flat(batch, self.pool)
        return self.model.lm_head(hidden, out=self.output)

    def capture(self, pool_handle: object) -> None:
        """Warm up on a side stream (compiles, lazy cuBLAS set-up), then capture."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.forward()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: only this (the engine) thread's CUDA calls are checked during capture.
        with torch.cuda.graph(self.graph, pool=pool_handle, capture_error_mode="thread_local"):
            self.forward()

    def replay(self) -> torch.Tensor:
        """Run the forward over the current static inputs (the captured graph on CUDA)."""
        if self.graph is None:
            return self.forward()
        self.graph.replay()
        return self.output


class GraphRunner:
    """The static forwards of one ModelRunner.

    ``capture``: record CUDA graphs (CUDA only); False runs the same padded static forward
    eagerly, which is what the CPU tests exercise.
    """

    def __init__(
        self,
        model: DecoderTransformer,
        pool: KVPool,
        device: torch.device,
        *,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        capture: bool,
    ) -> None:
        if pool.scratch_slots < 1:
            raise ValueError("graphed forwards need a scratch page in the KV pool")
        if capture and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model = model
        self.pool = pool
        self.device = device
        self.capture = capture
        self.max_tokens = padded_length(max_tokens)
        self.keys = graph_keys(self.max_tokens)
        # Positions never reach past the rope table built here; a graph reads that table's
        # memory, which the graph itself does not keep alive, so a reference is held here in
        # case a later, longer eager forward replaces the model's table with a bigger one.
        self.max_context = model.config.max_sequence_length
        model.rope(torch.zeros(1, dtype=torch.long, device=device), self.max_context)
        self._rope_tables = list(model._rope_tables.values())
        weight = model.embed_tokens.weight
        self.logits = torch.zeros(
            self.max_tokens, model.config.vocab_size, dtype=weight.dtype, device=device
        )
        self.graphs: dict[GraphKey, StaticForward] = {}
        # Shapes whose capture failed run eagerly from then on: a capture is never retried.
        self.failed: set[GraphKey] = set()
        self._pool_handle = torch.cuda.graph_pool_handle() if capture else None
        self.replays = 0  # forwards served by a static forward (metrics, tests, benchmarks)

    def key_for(self, rows: list[RowSpec]) -> GraphKey | None:
        """The key of a forward that can replay a graph, or None (it runs eagerly)."""
        tokens = logits = 0
        for row in rows:
            n = len(row.tokens)
            if row.kv is None or row.start + n > self.max_context:
                return None
            tokens += n
            logits += len(row.logits_at)
        if tokens > self.max_tokens:
            return None
        return GraphKey(padded_length(tokens), logits_bucket(logits))

    def static_for(self, key: GraphKey) -> StaticForward | None:
        """The static forward of ``key`` (captured now if new), or None when this shape failed
        to capture (the forward then runs eagerly)."""
        static = self.graphs.get(key)
        if static is not None or key in self.failed:
            return static
        static = StaticForward(
            key, self.model, self.pool, self.device,
            max_context=self.max_context, logits=self.logits,
        )  # fmt: skip
        if self.capture:
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
        self.graphs[key] = static
        return static

    def capture_all(self) -> float:
        """Capture every key up to the token limit (start-up); the seconds it took."""
        started = time.perf_counter()
        for key in self.keys:
            self.static_for(key)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - started
        logger.info(
            "CUDA graphs: %d captured (up to %d tokens per forward), %d failed, in %.1f s "
            "(compiling the attention kernel of each padded length included)",
            len(self.graphs), self.max_tokens, len(self.failed), seconds,
        )  # fmt: skip
        return seconds

    def run(self, static: StaticForward) -> torch.Tensor:
        """Replay ``static`` over its filled inputs: logits ``[key.logits, V]``."""
        out = static.replay()
        self.replays += 1
        return out
