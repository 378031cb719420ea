"""A draft-only LoRA for a tri-mode model (PEFT format), and the weight-view phase hooks.

Nemotron-Labs-Diffusion ships a LoRA on every layer's ``self_attn.o_proj`` that makes the
diffusion view a better drafter for LinearSpec. It must change the **draft** forwards only: the
verify forwards (and ``ar``, ``diffusion``, prefills) use the base weights, which is what keeps
LinearSpec exact. So the weight view is a property of the phase, not of the model:

- **Eager (this server today).** The base weights stay in ``o_proj``; each layer's
  :class:`LoRADelta` adds ``scale · B(A(x))`` to the ``o_proj`` output of the tokens a forward
  marks as draft tokens (``RowSpec.draft`` → ``FlatBatch.draft_index``). Draft and verify rows of
  different requests share one forward, and every non-draft token's output is the base
  projection bit for bit.
- **Captured graphs (a runtime that captures one graph per phase and batch bucket).** A graph
  records the weight tensors it reads, so the weight view must be set *before* capture and
  replay. :func:`weight_view_hooks` returns :class:`PhaseHooks` (SGLang's
  ``DllmGraphPhaseHooks`` idea): ``before_draft`` points each ``o_proj.weight`` at a merged
  ``W + scale · B A`` tensor and turns the per-token path off; ``before_verify`` points it back at
  the base tensor; ``after_graph`` restores the eager state. The ModelRunner holds them
  (``ModelRunner.phase_hooks``); CPU tests check that the merged view equals the per-token one.

PEFT format: ``adapter_config.json`` (``peft_type: LORA``, ``r``, ``lora_alpha``,
``target_modules``) and ``adapter_model.safetensors`` with
``base_model.model.encoder.layers.N.self_attn.o_proj.lora_{A,B}.weight`` (A ``[r, in]``,
B ``[out, r]``); scale ``lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``), as PEFT computes.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from dllm_serve.models.errors import ModelLoadError
from dllm_serve.models.hub import EMBEDDED_ADAPTERS
from dllm_serve.models.loader import LoadedModel
from dllm_serve.models.transformer import DecoderTransformer

_KEY = re.compile(
    r"base_model\.model\.encoder\.layers\.(\d+)\.self_attn\.o_proj\.lora_([AB])\.weight"
)
# PEFT keys that would change the network if set; refused rather than ignored.
_UNSUPPORTED = {"use_dora": False, "fan_in_fan_out": False, "bias": "none"}


class LoRADelta(nn.Module):
    """``scale · B(A(x))``: one linear layer's LoRA update (PEFT's ``lora_B(lora_A(x)) *
    scaling``), applied by :class:`~dllm_serve.models.layers.Attention` to draft tokens."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        super().__init__()
        self.lora_a = nn.Parameter(a, requires_grad=False)
        self.lora_b = nn.Parameter(b, requires_grad=False)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scale

    def merged(self, weight: torch.Tensor) -> torch.Tensor:
        """``W + scale · B A`` in ``weight``'s dtype (the draft view of a merged weight)."""
        delta = self.lora_b.float() @ self.lora_a.float() * self.scale
        return (weight.float() + delta).to(weight.dtype)


def _adapter_config(path: Path) -> dict[str, Any]:
    file = path / "adapter_config.json"
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read the draft LoRA's {file}: {e}") from None
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise ModelLoadError(f"{file}: peft_type {config.get('peft_type')!r} is not LORA")
    targets = config.get("target_modules")
    if targets not in (["o_proj"], "o_proj"):
        raise ModelLoadError(
            f"{file}: target_modules {targets!r}; only a LoRA on o_proj (the draft LoRA's "
            "target) is supported"
        )
    for key, want in _UNSUPPORTED.items():
        if config.get(key, want) not in (want, None):
            raise ModelLoadError(f"{file}: {key}={config[key]!r} is not supported ({want!r})")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if config.get(key):
            raise ModelLoadError(f"{file}: {key} is not supported (per-module ranks or saved "
                                 "modules)")  # fmt: skip
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float):
        raise ModelLoadError(f"{file}: needs a positive integer r and a number lora_alpha")
    return config


def read_draft_lora(
    path: str | Path, model: DecoderTransformer
) -> tuple[float, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """``(scale, {layer: (A, B)})`` of a PEFT adapter for ``model`` (a directory, or the name
    of an adapter shipped with an embedded model: ``demo-trimode-lora``), every name and shape
    checked (a :class:`ModelLoadError` names what does not fit)."""
    path = Path(EMBEDDED_ADAPTERS.get(str(path), path))
    config = _adapter_config(path)
    rank = int(config["r"])
    scale = config["lora_alpha"] / (math.sqrt(rank) if config.get("use_rslora") else rank)
    try:
        tensors = load_file(str(path / "adapter_model.safetensors"))
    except (OSError, SafetensorError) as e:
        raise ModelLoadError(f"cannot read the draft LoRA's adapter_model.safetensors: {e}") from e
    cfg = model.config
    ranks = model.tp.size if model.tp is not None else 1  # a shard holds 1/ranks of the heads
    shapes = {"A": (rank, ranks * cfg.n_heads * cfg.head_dim), "B": (cfg.d_model, rank)}
    found: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _KEY.fullmatch(name)
        if match is None:
            raise ModelLoadError(f"draft LoRA tensor {name!r} is not an o_proj lora_A/lora_B")
        layer, ab = int(match[1]), match[2]
        if layer >= cfg.n_layers or tuple(tensor.shape) != shapes[ab]:
            raise ModelLoadError(
                f"draft LoRA tensor {name} {list(tensor.shape)} does not fit the model "
                f"({cfg.n_layers} layers; lora_{ab} must be {list(shapes[ab])})"
            )
        found.setdefault(layer, {})[ab] = tensor
    if not found or any(len(pair) != 2 for pair in found.values()):
        raise ModelLoadError(f"{path}: every adapted layer needs both lora_A and lora_B")
    return scale, {i: (pair["A"], pair["B"]) for i, pair in sorted(found.items())}


def attach_draft_lora(model: DecoderTransformer, path: str | Path) -> int:
    """Give ``model``'s layers the draft LoRA of ``path`` (in the model's dtype and device);
    returns the number of adapted layers."""
    scale, layers = read_draft_lora(path, model)
    weight = model.embed_tokens.weight
    width = model.config.n_heads * model.config.head_dim
    for i, (a, b) in layers.items():
        if model.tp is not None:
            # Tensor parallelism: A reads this rank's heads (o_proj is row-parallel, so each
            # rank adds B·A_r·x_r to its partial sum and the all-reduce sums them: exact).
            a = a[:, model.tp.rank * width : (model.tp.rank + 1) * width]
        attn = model.layers[i].attn
        attn.draft_lora = LoRADelta(
            a.to(weight.device, weight.dtype), b.to(weight.device, weight.dtype), scale
        )
    return len(layers)


def attach_served_draft_lora(loaded: LoadedModel, path: str | Path) -> int:
    """:func:`attach_draft_lora` on a loaded model (rank 0's shard under tensor parallelism:
    the workers attach their own), after checking that it drafts: only tri-mode models do, and
    on any other the adapter would load and never be used."""
    if not loaded.family.tri_mode:
        raise ModelLoadError(
            f"the draft LoRA (--draft-lora) applies to tri-mode models "
            f"(Nemotron-Labs-Diffusion); {loaded.name!r} is a {loaded.family.name} model"
        )
    return attach_draft_lora(loaded.model, path)


def _noop() -> None:
    pass


@dataclass(frozen=True)
class PhaseHooks:
    """Weight-view callbacks a graph-capturing runtime calls before capturing or replaying a
    phase's graph (draft or verify), and after either to restore the eager state."""

    before_draft: Callable[[], None] = _noop
    before_verify: Callable[[], None] = _noop
    after_graph: Callable[[], None] = _noop


def weight_view_hooks(model: DecoderTransformer) -> PhaseHooks:
    """The :class:`PhaseHooks` of ``model``'s draft LoRA (no-ops without one).

    Merged weights are computed on the first ``before_draft`` (one extra ``o_proj`` per
    adapted layer) and swapped in by pointer (``param.data``), so a captured graph keeps
    reading the tensor that was active when it was captured.
    """
    adapted = [layer.attn for layer in model.layers if layer.attn.draft_lora is not None]
    if not adapted:
        return PhaseHooks()
    deltas = [attn.draft_lora for attn in adapted]
    base = [attn.o_proj.weight.data for attn in adapted]
    merged: list[torch.Tensor] = []

    def before_draft() -> None:
        if not merged:
            merged.extend(d.merged(w) for d, w in zip(deltas, base, strict=True))
        for attn, w in zip(adapted, merged, strict=True):
            attn.o_proj.weight.data = w
            attn.draft_lora = None  # the merged weight already holds the update

    def before_verify() -> None:
        for attn, w in zip(adapted, base, strict=True):
            attn.o_proj.weight.data = w
            attn.draft_lora = None

    def after_graph() -> None:
        for attn, w, delta in zip(adapted, base, deltas, strict=True):
            attn.o_proj.weight.data = w
            attn.draft_lora = delta

    return PhaseHooks(before_draft, before_verify, after_graph)
