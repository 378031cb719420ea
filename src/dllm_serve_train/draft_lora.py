"""Training a tri-mode model's draft LoRA (PEFT format, on every layer's ``o_proj``).

The base weights are frozen; each layer's ``o_proj`` output gets ``scale · B(A(x))`` on the
noisy-block tokens only (the tokens a LinearSpec draft forward computes in the draft view; the
causal prefix it attends to was cached with the base weights), and only the diffusion loss
on drafts is trained (:func:`~dllm_serve_train.trimode_objective.trimode_batch` with
``lora_stage``). ``B`` starts at zero, as PEFT initialises it, so training starts from the
base model's drafts. The result is written as ``adapter_config.json`` +
``adapter_model.safetensors`` under the names ``models/lora.py`` reads.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from dllm_serve.models.transformer import DecoderTransformer
from dllm_serve_train.tiny_checkpoints.files import readable
from dllm_serve_train.tiny_checkpoints.nemotron import LORA_PREFIX


class TrainableDraftLoRA(nn.Module):
    """LoRA factors for every layer's ``o_proj``, applied through forward hooks to the tokens
    of :attr:`token_mask` (``[B, L]`` bool, set before each forward)."""

    def __init__(self, model: DecoderTransformer, rank: int, alpha: float, seed: int) -> None:
        super().__init__()
        cfg = model.config
        gen = torch.Generator().manual_seed(seed)
        width = cfg.n_heads * cfg.head_dim
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        # PEFT's init: A Kaiming-uniform, B zero (the adapter starts as the identity update).
        bound = 1.0 / math.sqrt(width)
        self.lora_a = nn.ParameterList(
            nn.Parameter((torch.rand(rank, width, generator=gen) * 2 - 1) * bound)
            for _ in range(cfg.n_layers)
        )
        self.lora_b = nn.ParameterList(
            nn.Parameter(torch.zeros(cfg.d_model, rank)) for _ in range(cfg.n_layers)
        )
        self.token_mask: torch.Tensor | None = None
        self._handles = [
            layer.attn.o_proj.register_forward_hook(self._hook(i))
            for i, layer in enumerate(model.layers)
        ]

    def _hook(self, layer: int):
        def add_delta(_module: nn.Module, inputs: tuple[torch.Tensor], out: torch.Tensor):
            if self.token_mask is None:
                return out
            delta = inputs[0] @ self.lora_a[layer].T @ self.lora_b[layer].T * self.scale
            return out + delta * self.token_mask[..., None].to(out.dtype)

        return add_delta

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def save(self, out: Path, base_name: str) -> None:
        """PEFT files: ``adapter_config.json`` and ``adapter_model.safetensors`` (bf16)."""
        out.mkdir(parents=True, exist_ok=True)
        config = {
            "peft_type": "LORA",
            "task_type": None,
            "base_model_name_or_path": base_name,
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": 0.0,
            "target_modules": ["o_proj"],
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": False,
            "use_dora": False,
            "inference_mode": True,
        }
        (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        tensors = {}
        for i, (a, b) in enumerate(zip(self.lora_a, self.lora_b, strict=True)):
            name = f"{LORA_PREFIX}.{i}.self_attn.o_proj"
            tensors[f"{name}.lora_A.weight"] = a.detach().to(torch.bfloat16).contiguous()
            tensors[f"{name}.lora_B.weight"] = b.detach().to(torch.bfloat16).contiguous()
        save_file(tensors, str(out / "adapter_model.safetensors"))
        for file in out.iterdir():
            readable(file)
