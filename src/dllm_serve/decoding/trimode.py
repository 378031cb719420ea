"""A tri-mode model's algorithm: each request decodes by its own ``decoding_mode``.

Nemotron-Labs-Diffusion runs one set of weights three ways (``decoding/modes.py``):
``ar`` (causal decoding with the KV cache: I-DLM's exact decoder at stride 1, which is plain
greedy/sampled AR), ``diffusion`` (``causal_diffusion.py``) and ``linear_spec``
(``linear_spec.py``). :class:`TriModeDecoder` routes every call to the request's mode, so rows
of different modes share one forward: each row carries its own attention kind, positions,
KV span and weight view, and the samplers are per row. A request's state records its resolved
mode in ``state.params.decoding_mode``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dllm_serve.decoding.algorithm import DecodeState, DecodingAlgorithm
from dllm_serve.decoding.forward_spec import RowSpec, StepResult
from dllm_serve.decoding.host_values import to_device
from dllm_serve.decoding.modes import TRI_MODE, TRI_MODES
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.decoding.sharded_vocab import ShardedLogits, select_rows


class TriModeDecoder:
    """Dispatches to one algorithm per mode (``modes``); ``default`` serves requests that name
    none (the server's ``--decoding-mode``)."""

    decoding_mode = TRI_MODE

    def __init__(self, modes: Mapping[str, DecodingAlgorithm], default: str) -> None:
        if set(modes) != set(TRI_MODES):
            raise ValueError(f"a tri-mode decoder needs the modes {TRI_MODES}, got {set(modes)}")
        if default not in modes:
            raise ValueError(f"default decoding mode {default!r} is not one of {TRI_MODES}")
        self.modes = dict(modes)
        self.default = default

    def mode_of(self, params: DecodingParams) -> str:
        mode = params.decoding_mode or self.default
        if mode not in self.modes:
            raise ValueError(f"decoding_mode {mode!r} is not one of this model's {TRI_MODES}")
        return mode

    def _algorithm(self, state: Any) -> DecodingAlgorithm:
        return self.modes[state.params.decoding_mode]

    def init_state(
        self, prompt_ids: Sequence[int], params: DecodingParams, device: torch.device | str
    ) -> DecodeState:
        resolved = dataclasses.replace(params, decoding_mode=self.mode_of(params))
        return self.modes[resolved.decoding_mode].init_state(prompt_ids, resolved, device)

    def kv_tokens(self, prompt_len: int, params: DecodingParams) -> int:
        """The widest mode's need (a few slots more than ``ar`` needs): what the KV pool is
        sized for, whatever mode the requests pick."""
        return max(m.kv_tokens(prompt_len, params) for m in self.modes.values())

    def prepare(self, state: DecodeState) -> RowSpec:
        return self._algorithm(state).prepare(state)

    def sample(
        self, states: Sequence[DecodeState], logits: torch.Tensor | ShardedLogits
    ) -> torch.Tensor:
        """Each mode's sampler on its own rows; their outputs side by side, ``[R, W]`` (rows
        narrower than ``W`` are padded with zeros, which no commit reads)."""
        groups: dict[str, list[int]] = {}
        for r, state in enumerate(states):
            groups.setdefault(state.params.decoding_mode, []).append(r)  # type: ignore[arg-type]
        if len(groups) == 1:
            return self.modes[next(iter(groups))].sample(states, logits)
        parts = []
        for mode, rows in groups.items():
            index = to_device(rows, logits.device)
            sub = self.modes[mode].sample([states[r] for r in rows], select_rows(logits, rows))
            parts.append((index, sub))
        width = max(sub.shape[1] for _, sub in parts)
        out = torch.zeros(len(states), width, dtype=torch.long, device=logits.device)
        for index, sub in parts:
            out[index, : sub.shape[1]] = sub.to(torch.long)
        return out

    def commit(
        self, states: Sequence[DecodeState], host: Sequence[Sequence[int]]
    ) -> list[StepResult]:
        return [
            self._algorithm(s).commit([s], [row])[0] for s, row in zip(states, host, strict=True)
        ]
