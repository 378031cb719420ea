"""A draft-only LoRA for a tri-mode model (PEFT format).

Nemotron-Labs-Diffusion ships a LoRA on every layer's ``self_attn.o_proj`` that makes the
diffusion view a better drafter for LinearSpec. It must change the **draft** forwards only: the
verify forwards (and ``ar``, ``diffusion``, prefills) use the base weights, which is what keeps
LinearSpec exact. So the weight view is a property of the token, not of the model.

The base weights stay in ``o_proj``; each layer's :class:`LoRADelta` computes
``scale · B(A(x))`` and adds it to the ``o_proj`` output of the tokens a forward flags as draft
tokens (``RowSpec.draft`` → ``FlatBatch.draft``), every other token keeping the base projection
bit for bit. Draft and verify rows of different requests share one forward, eager or a captured
graph: the update is computed for every token and selected per token, so the shapes do not
depend on which rows draft (no weight swap per phase, no graph per phase).

PEFT format: ``adapter_config.json`` (``peft_type: LORA``, ``r``, ``lora_alpha``,
``target_modules``) and ``adapter_model.safetensors`` with
``base_model.model.encoder.layers.N.self_attn.o_proj.lora_{A,B}.weight`` (A ``[r, in]``,
B ``[out, r]``); scale ``lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``), as PEFT computes.
"""

from __future__ import annotations

import json
import math
import re
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
