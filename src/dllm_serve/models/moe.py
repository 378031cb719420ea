"""The mixture-of-experts feed-forward of LLaDA2.x and LLaDA-MoE.

.. code-block:: text

    (w, chosen) = route(x)                       models/routing.py, in fp32
    y = Σ_{i ∈ chosen} w_i · expert_i(x) + shared(x)

Every expert and the optional shared expert is a SwiGLU ``down(silu(gate(x)) · up(x))``; the
shared one is always on. The routing rule (LLaDA2's sigmoid group-limited top-k, or
LLaDA-MoE's softmax top-k) is pluggable through ``MoEConfig.routing``.

The computation is grouped by expert: the (token, slot) picks are sorted by expert id, each
expert that received tokens runs once on its contiguous run (one matmul per active expert, no
loop over tokens), and each token's ``top_k`` outputs are summed in slot order. Fused
grouped-GEMM kernels are what the fast engines add on GPU; this is their reference layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dllm_serve.models.layers import MLP
from dllm_serve.models.routing import route
from dllm_serve.models.transformer_config import MoEConfig

__all__ = ["FP32_PARAMETERS", "MoE", "Router", "route"]

# Parameters (suffixes of their names in DecoderTransformer) the loader keeps in fp32 whatever
# the model's dtype: routing is computed in fp32, and rounding the router to bf16 would move
# the near-tied scores that decide which experts run.
FP32_PARAMETERS = ("mlp.router.weight", "mlp.router.expert_bias")


class Router(nn.Module):
    """The gate ``weight`` ``[E, d_model]``, plus the selection-only ``expert_bias`` ``[E]``
    for the routing rule that has one (sigmoid group-limited)."""

    def __init__(self, d_model: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, d_model))
        self.expert_bias: nn.Parameter | None = None
        if cfg.routing == "sigmoid_group_limited":
            self.expert_bias = nn.Parameter(torch.zeros(cfg.num_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``route`` of tokens ``x`` ``[T, d_model]``, logits computed in fp32."""
        logits = F.linear(x.float(), self.weight.float())
        return route(logits, self.expert_bias, self.cfg)


class MoE(nn.Module):
    """Routed SwiGLU experts plus an optional always-on shared expert (module docstring)."""

    def __init__(self, d_model: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = Router(d_model, cfg)
        # Under expert parallelism only this rank's experts (cfg.local_experts), indexed from 0.
        self.experts = nn.ModuleList(
            MLP(d_model, cfg.expert_hidden_size) for _ in cfg.local_experts
        )
        self.shared = MLP(d_model, cfg.shared_hidden_size) if cfg.shared_hidden_size else None

    def fuse(self) -> None:
        """Fuse every expert's gate and up projections (same outputs, fewer kernels)."""
        for expert in self.experts:
            expert.fuse()
        if self.shared is not None:
            self.shared.fuse()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, ids = self.router(flat)
        k = self.cfg.top_k
        # Sort the (token, slot) picks by expert: each expert then reads one contiguous run.
        picks = ids.flatten()
        order = picks.argsort(stable=True)
        counts = torch.bincount(picks, minlength=self.cfg.num_experts).tolist()  # one sync
        local = self.cfg.local_experts
        # Under expert parallelism the picks of other ranks' experts stay zero here: each rank
        # returns a partial sum, which the tensor-parallel all-reduce completes.
        out = (flat.new_zeros if len(local) < len(counts) else flat.new_empty)(
            picks.shape[0], shape[-1]
        )
        start = sum(counts[: local.start])
        for expert, count in zip(self.experts, counts[local.start : local.stop], strict=True):
            if count:
                rows = order[start : start + count]
                out[rows] = expert(flat[rows // k])
                start += count
        # Combine in fp32, each token's k outputs in slot order: the same sum however the
        # batch is composed (no atomics), so a request's tokens do not depend on its neighbours.
        routed = (out.view(-1, k, shape[-1]).float() * weights.unsqueeze(-1)).sum(1)
        y = routed.to(x.dtype)
        if self.shared is not None:
            y = y + self.shared(flat)
        return y.view(shape)
