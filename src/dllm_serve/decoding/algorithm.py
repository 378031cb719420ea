"""The two protocols every decoding mode implements: its per-request state and its step.

A step of the engine is ``prepare`` (host: one :class:`RowSpec` per row) → the ModelRunner's
forward → ``sample`` (device: tensor in, tensor out, batched over rows, nothing read back) →
one device→host copy (``tolist``) by the engine → ``commit`` (host: apply, count, detect the
end). LLaDA-style denoising (``denoise.py``), block diffusion (``block_diffusion.py``, and
``causal_diffusion.py`` over a causal prefix; Fast-dLLM v2's ``fast_dllm.py``), I-DLM
self-speculation (``isd.py``), LinearSpec
(``linear_spec.py``) and the tri-mode dispatcher over them (``trimode.py``) implement it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from dllm_serve.decoding.forward_spec import RowSpec, StepResult
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.decoding.sharded_vocab import ShardedLogits
from dllm_serve.models.kv_pool import KVSpan


class DecodeState(Protocol):
    """What the engine reads of a request's decoding state."""

    params: DecodingParams
    nfe: int
    committed: int
    block: int
    finished: bool
    finish_reason: str | None
    kv: KVSpan | None
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

    def sample(
        self, states: Sequence[DecodeState], logits: torch.Tensor | ShardedLogits
    ) -> torch.Tensor:
        """The step's device result ``[R, W]`` from its logits ``[R, M, V]``: a dense tensor,
        or under tensor parallelism logits sharded by vocabulary (``sharded_vocab.py``)."""
        ...

    def commit(
        self, states: Sequence[DecodeState], host: Sequence[Sequence[int]]
    ) -> list[StepResult]: ...
