"""Shared helpers for the decoding tests: a deterministic mock LM and a driver loop.

Not collected by pytest (no ``test_`` prefix); imported by the test modules next to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from dllm_serve.decoding.blocks import DenoiseState
from dllm_serve.decoding.canvas import LLaDADenoiser
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.decoding.protocol import AttentionKind, RowSpec, StepResult

VOCAB = 40
MASK_ID = 39
EOS_ID = 2
EOT_ID = 3


class Model(Protocol):
    """Anything that answers a RowSpec with logits ``[len(logits_index), V]``."""

    def forward(self, spec: RowSpec) -> torch.Tensor: ...


class MockLM:
    """A tiny fixed random network whose logits depend on *every* canvas token.

    Each position's hidden state is its token embedding plus a position embedding, mixed with
    the mean over the whole canvas (bidirectional), so committing a token anywhere changes the
    logits everywhere and confidences vary between positions and steps.
    ``mask_logit`` overrides the mask id's logit (very low: the reference never proposes it;
    very high: an adversarial model that always prefers it). ``bias`` ``[max_len, V]`` is added
    to the logits (e.g. to make EOS confident at one position).
    """

    def __init__(
        self,
        seed: int = 0,
        scale: float = 3.0,
        vocab: int = VOCAB,
        dim: int = 16,
        max_len: int = 128,
        mask_id: int = MASK_ID,
        mask_logit: float | None = -1e4,
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tok = torch.randn(vocab, dim, generator=g)
        self.pos = torch.randn(max_len, dim, generator=g)
        self.mix = torch.randn(dim, dim, generator=g) / dim**0.5
        self.head = torch.randn(dim, vocab, generator=g) * scale / dim**0.5
        self.bias = torch.zeros(max_len, vocab)
        self.mask_id = mask_id
        self.mask_logit = mask_logit

    def __call__(self, input_ids: torch.Tensor, causal: bool = False) -> torch.Tensor:
        """Full-canvas logits ``[L, V]`` (float32) for a 1-D canvas ``[L]``.

        ``causal``: position i mixes in the mean over positions ``0..i`` only (a causal
        model), instead of the mean over the whole canvas.
        """
        n = input_ids.numel()
        h = self.tok[input_ids] + self.pos[:n]
        if causal:
            mean = h.cumsum(0) / torch.arange(1, n + 1).unsqueeze(1)
        else:
            mean = h.mean(0, keepdim=True)
        ctx = torch.tanh(mean @ self.mix)
        logits = torch.tanh(h + ctx) @ self.head + self.bias[:n]
        if self.mask_logit is not None:
            logits[:, self.mask_id] = self.mask_logit
        return logits

    def forward(self, spec: RowSpec) -> torch.Tensor:
        """What the engine does: logits only at ``spec.logits_index``, honouring attention."""
        causal = spec.attention is AttentionKind.CAUSAL
        return self(spec.input_ids, causal=causal)[spec.logits_index]


@dataclass
class StepRecord:
    """One update as seen from outside: canvases around it and the block it worked on."""

    before: torch.Tensor
    after: torch.Tensor
    block: int
    step: int
    lo: int
    hi: int
    scheduled: int | None  # None in the data-dependent modes (threshold, LocalLeap)
    logits_index: torch.Tensor
    result: StepResult


def step(denoiser: LLaDADenoiser, state: DenoiseState, model: Model) -> StepResult:
    spec = denoiser.prepare(state)
    return denoiser.update(state, model.forward(spec))


def run(
    denoiser: LLaDADenoiser,
    state: DenoiseState,
    model: Model,
    max_steps: int = 10_000,
) -> list[StepRecord]:
    """Drive ``state`` to completion and return a record per update."""
    records: list[StepRecord] = []
    for _ in range(max_steps):
        if state.finished:
            return records
        lo, hi = state.active_block
        block, step_i = state.block, state.step
        scheduled = state.schedule[state.step] if state.schedule else None
        spec = denoiser.prepare(state)
        before = state.canvas.clone()
        result = denoiser.update(state, model.forward(spec))
        records.append(
            StepRecord(
                before,
                state.canvas.clone(),
                block,
                step_i,
                lo,
                hi,
                scheduled,
                spec.logits_index.clone(),
                result,
            )
        )
    raise AssertionError("denoising did not finish")


def truncate_at_stop(tokens: list[int], stop_ids: tuple[int, ...]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[:i]
    return tokens


class ScriptedLM:
    """Logits scripted per forward call: ``script[call][position] = (token, probability)``.

    Positions not in the call's entry get a flat distribution (top-1 probability ``1/38``
    over the 38 tokens that are neither ``avoid`` nor the mask id). The ``probability`` is the
    exact top-1 probability: the rest of the mass is spread evenly over the other tokens.
    """

    def __init__(self, script: list[dict[int, tuple[int, float]]], vocab: int = VOCAB) -> None:
        self.script = script
        self.vocab = vocab
        self.calls = 0

    def forward(self, spec: RowSpec) -> torch.Tensor:
        entry = self.script[min(self.calls, len(self.script) - 1)]
        self.calls += 1
        rows = []
        others = self.vocab - 1  # every token but the mask id
        for pos in spec.logits_index.tolist():
            p = torch.zeros(self.vocab, dtype=torch.float64)
            token, prob = entry.get(pos, (10, 1.0 / others))
            p[:] = (1.0 - prob) / (others - 1)
            p[token] = prob
            p[MASK_ID] = 0.0
            rows.append(p.log())
        return torch.stack(rows) if rows else torch.empty(0, self.vocab, dtype=torch.float64)


def decode(
    params: DecodingParams,
    model: Model,
    stop_ids: tuple[int, ...] = (),
    prompt: list[int] | None = None,
    **denoiser_kwargs: bool,
) -> tuple[DenoiseState, list[StepRecord]]:
    """Run one request alone to completion: (final state, a record per step)."""
    denoiser = LLaDADenoiser(MASK_ID, stop_ids, **denoiser_kwargs)
    state = denoiser.init_state(prompt or [5, 17, 8, 30, 11], params, "cpu")
    return state, run(denoiser, state, model)
