"""The contract between the engine, a decoding algorithm and the model forward.

A step of the engine is ``prepare`` (host: one :class:`RowSpec` per row) → the ModelRunner's
forward → ``sample`` (device: tensor in, tensor out, batched over rows, nothing read back) →
one device→host copy (``tolist``) by the engine → ``commit`` (host: apply, count, detect the
end). Every decoding algorithm implements :class:`DecodingAlgorithm` over its own per-request
state (a :class:`DecodeState`): LLaDA-style canvas denoising (``canvas.py``), block diffusion
(``blocks.py``; Fast-dLLM v2's ``fast_dllm.py``), I-DLM self-speculation (``selfspec.py``),
LinearSpec (``linear_spec.py``) and the tri-mode dispatcher over them (``registry.py``).

An algorithm describes each row of a forward as a :class:`RowSpec` (host data only: token ids,
where the row starts, which outputs it needs, its attention kind and its KV span); the
ModelRunner packs the rows of a step into one flat batch, runs the model and returns the
logits as ``[rows, M, V]`` (row ``r``'s ``len(logits_at)`` entries first, padding after), or,
under tensor parallelism, as :class:`ShardedLogits` whose vocabulary stays split over the
ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple, Protocol, runtime_checkable

import torch

from dllm_serve.decoding.params import DecodingParams
from dllm_serve.models.kv_pool import KVPages

# ---- rows of a forward -------------------------------------------------------------------------


class AttentionKind(StrEnum):
    BIDIRECTIONAL = "bidirectional"
    CAUSAL = "causal"
    # Bidirectional inside blocks of ``RowSpec.block`` tokens aligned to position 0, causal
    # across them (block diffusion's prefill of whole prompt blocks).
    BLOCK_CAUSAL = "block_causal"


@dataclass(slots=True)
class RowSpec:
    """What one row needs from one model forward.

    ``tokens`` are the row's query tokens, at rotary positions ``start, start + 1, …``.
    ``logits_at`` lists offsets into ``tokens`` whose logits the algorithm needs (the LM head
    runs only there: a full-vocabulary head over the whole canvas dominates the step time).

    KV: with ``kv`` (the request's span in the KV pool) the row's queries also attend to the
    span's cached prefix, positions ``[0, start)`` — so ``start`` must equal what the span
    holds — and the K/V of all ``tokens`` are written to their slots; the algorithm then says
    how many of them the request keeps (``KVPages.length``). Without ``kv`` the row attends to
    its own tokens only. ``attention`` applies among the current tokens and towards the prefix:
    CAUSAL sees every earlier position, BIDIRECTIONAL sees all of them.

    ``draft``: the row is computed in the draft weight view (``models/lora.py``).
    """

    tokens: list[int]
    start: int
    logits_at: list[int]
    attention: AttentionKind = AttentionKind.BIDIRECTIONAL
    kv: KVPages | None = None
    block: int = 0  # the block size of BLOCK_CAUSAL attention
    # The draft weight view (a tri-mode model's draft-only LoRA applies to this row's tokens);
    # False: base weights. A property of the phase, never of the request.
    draft: bool = False
    # A per-row device input for a model that takes one (DiffusionGemma's self-conditioning
    # signal, ``[len(tokens), d_model]``); opaque to the engine, which hands it to the model
    # with the row's place in the flat batch (``FlatBatch.row_inputs``). None for every other
    # family.
    model_input: object | None = None

    @property
    def causal(self) -> bool:
        return self.attention is AttentionKind.CAUSAL

    def check(self) -> None:
        """A row must forward tokens and ask for at least one position's logits."""
        if not self.tokens or not self.logits_at:
            raise ValueError("a row needs tokens and at least one requested output")

    # Tensor views for tests and simple callers (the runner packs the host lists directly).
    @property
    def input_ids(self) -> torch.Tensor:
        return torch.tensor(self.tokens, dtype=torch.long)

    @property
    def positions(self) -> torch.Tensor:
        return torch.arange(self.start, self.start + len(self.tokens))

    @property
    def logits_index(self) -> torch.Tensor:
        return torch.tensor(self.logits_at, dtype=torch.long)


@dataclass(slots=True)
class StepResult:
    """What one step did to one request."""

    committed: int  # tokens committed this step
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" when finished
    new_tokens: int = 0  # answer tokens that became final (streamable) this step


# ---- logits sharded by vocabulary --------------------------------------------------------------


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
        from its generator (exactly as :func:`~dllm_serve.decoding.sampler.gumbel_argmax`
        on the full vocabulary, and advancing the generator alike)."""
        ...

    def dense(self, rows: Sequence[int]) -> torch.Tensor:
        """The full-vocabulary logits ``[len(rows), M, V]`` of ``rows`` (gathered)."""
        ...


# ---- a step's logits ---------------------------------------------------------------------------


@dataclass(slots=True)
class StepLogits:
    """One step's logits at the requested positions only.

    Dense: ``flat`` ``[N, V]`` holds every row's requested positions back to back, row ``r``'s
    ``counts[r]`` of them at ``flat[offsets[r] : offsets[r] + counts[r]]`` in the order its
    :class:`RowSpec` asked for them, so the LM head, the softmax and the argmax run on real
    positions only; ``index`` ``[R, M]`` (``M`` the most any row asked for) maps row ``r``'s
    ``j``-th position to its flat index (past a row's own, its first again), to lay the small
    per-position results (a token, a confidence) out per row for the commit rules.

    Under tensor parallelism ``sharded`` holds the logits instead (``[R, M, V]``, vocabulary
    split over the ranks; :class:`ShardedLogits`) and ``flat`` is None.
    """

    flat: torch.Tensor | None
    counts: list[int]
    offsets: list[int]
    index: torch.Tensor | None
    sharded: ShardedLogits | None = None

    @classmethod
    def padded(cls, logits: torch.Tensor | ShardedLogits) -> StepLogits:
        """Logits laid out per row, ``[R, M, V]`` (every row ``M`` positions; a shorter row's
        tail is padding its algorithm ignores): a graph replay's, or a test's."""
        rows, width = logits.shape[0], logits.shape[1]
        counts, offsets = [width] * rows, list(range(0, rows * width, width))
        if not isinstance(logits, torch.Tensor):
            return cls(None, counts, offsets, None, sharded=logits)
        index = torch.arange(rows * width, device=logits.device).view(rows, width)
        return cls(logits.reshape(rows * width, -1), counts, offsets, index)

    @property
    def rows(self) -> int:
        return len(self.counts)

    @property
    def width(self) -> int:
        """``M``: the most positions any row asked for."""
        return max(self.counts) if self.counts else 0

    @property
    def device(self) -> torch.device:
        return self.flat.device if self.flat is not None else self.sharded.device  # type: ignore[union-attr]

    def row(self, r: int) -> torch.Tensor:
        """Row ``r``'s logits ``[counts[r], V]`` (a view; dense only)."""
        assert self.flat is not None
        return self.flat[self.offsets[r] : self.offsets[r] + self.counts[r]]

    def per_row(self, values: torch.Tensor) -> torch.Tensor:
        """Per-position ``values`` ``[N, ...]`` laid out per row: ``[R, M, ...]``."""
        assert self.index is not None
        return values[self.index]

    def as_padded(self) -> torch.Tensor | ShardedLogits:
        """The logits laid out per row, ``[R, M, V]`` (a copy when flat; for tests and tools:
        the samplers never need it)."""
        if self.sharded is not None:
            return self.sharded
        assert self.flat is not None
        return self.per_row(self.flat)

    @property
    def shape(self) -> torch.Size:
        """``[R, M, V]``: the per-row layout's shape."""
        vocab = self.flat.shape[-1] if self.flat is not None else self.sharded.shape[-1]  # type: ignore[union-attr]
        return torch.Size((self.rows, self.width, vocab))

    def __getitem__(self, key: object) -> torch.Tensor:
        """Indexing reads the per-row layout (tests and tools)."""
        return self.as_padded()[key]  # type: ignore[index]


def logit_layout(counts: Sequence[int]) -> tuple[list[int], list[int]]:
    """Each row's offset among the flat requested positions, and the flat index of each row's
    ``j``-th position ``[R, M]`` row-major (past a row's own positions, its first again)."""
    width = max(counts)
    offsets: list[int] = []
    index: list[int] = []
    offset = 0
    for count in counts:
        offsets.append(offset)
        index.extend(range(offset, offset + count))
        index.extend([offset] * (width - count))
        offset += count
    return offsets, index


def as_step_logits(logits: torch.Tensor | ShardedLogits | StepLogits) -> StepLogits:
    """A step's logits whatever form they come in (padded per row: :meth:`StepLogits.padded`)."""
    return logits if isinstance(logits, StepLogits) else StepLogits.padded(logits)


# ---- state and algorithm -----------------------------------------------------------------------


class DecodeState(Protocol):
    """What the engine reads of a request's decoding state."""

    params: DecodingParams
    nfe: int
    committed: int
    block: int
    finished: bool
    finish_reason: str | None
    kv: KVPages | None
    drafted: int | None  # self-speculation only (None for diffusion decoding)
    accepted_drafts: int | None

    @property
    def step(self) -> int: ...

    @property
    def row_length(self) -> int:
        """Tokens the request's next row puts in a forward."""
        ...

    @property
    def is_prefill(self) -> bool:
        """Whether the next row is a prefill (the prompt itself) rather than a decode step."""
        ...

    def answer_tokens(self) -> list[int]:
        """The final answer so far (committed, contiguous, stop id excluded)."""
        ...


class DecodingAlgorithm(Protocol):
    """One decoding mode, batched over the rows of a step."""

    # "diffusion" | "block_diffusion" | "self_speculation" | "tri_mode": which fields apply
    decoding_mode: str

    def init_state(
        self, prompt_ids: Sequence[int], params: DecodingParams, device: torch.device | str
    ) -> DecodeState: ...

    def kv_tokens(self, prompt_len: int, params: DecodingParams) -> int:
        """KV-pool slots a request needs for its whole life (0: it keeps no K/V)."""
        ...

    def prepare(self, state: DecodeState) -> RowSpec: ...

    def sample(self, states: Sequence[DecodeState], logits: StepLogits) -> torch.Tensor:
        """The step's device result ``[R, W]`` from its logits at the requested positions
        (:class:`StepLogits`: dense and flat, or under tensor parallelism sharded by
        vocabulary; a padded ``[R, M, V]`` tensor is accepted too)."""
        ...

    def commit(
        self, states: Sequence[DecodeState], host: Sequence[Sequence[int]]
    ) -> list[StepResult]: ...


@runtime_checkable
class PrefixReuse(Protocol):
    """An algorithm whose requests may start from K/V that another request computed (the
    engine's prefix cache, ``models/prefix_cache.py``): one whose kept K/V at a position depend only
    on the tokens up to the end of that position's block — causal, or block-causal with final
    blocks — so reusing them is exact. Canvas denoising (bidirectional over the canvas) is not.

    ``prefix_alignment``: a hit is a whole number of these tokens (the block of block-causal
    attention; 1 for causal). The engine gives a hit of ``tokens`` positions to a new state
    whose ``kv`` already holds them (``kv.length == tokens``) through :meth:`reuse_prefix`.
    """

    prefix_alignment: int

    def prefix_limit(self, prompt_len: int, params: DecodingParams) -> int:
        """The most leading prompt positions a request may take from a cache (its first
        forward must still compute whatever gives its first logits)."""
        ...

    def reuse_prefix(self, state: DecodeState, tokens: int) -> None:
        """Start ``state`` past the first ``tokens`` prompt positions, cached already."""
        ...
