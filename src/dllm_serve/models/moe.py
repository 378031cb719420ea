"""The mixture-of-experts feed-forward of LLaDA2.x (Ling 2.0 / BailingMoeV2 lineage).

Routing of one token ``x`` (``d_model``) over ``E`` experts split into ``G`` equal groups, all
in fp32 (the checkpoints' ``router_dtype``):

.. code-block:: text

    s      = sigmoid(W_gate · x)                 [E]  the scores
    b      = s + expert_bias                     [E]  used only to *choose* experts
    g_j    = sum of the 2 largest b in group j   [G]
    kept   = the topk_group groups with the largest g_j
    chosen = the top_k experts by b among the kept groups' experts
    w_i    = s_i / (Σ_{c ∈ chosen} s_c + 1e-20) · routed_scaling_factor      (i ∈ chosen)

    y = Σ_{i ∈ chosen} w_i · expert_i(x) + shared(x)

The bias (learned for load balancing) changes *which* experts run but never their weight:
the weights are the unbiased scores, renormalised over the chosen experts
(``norm_topk_prob``) and scaled. Every expert and the shared expert is a SwiGLU
``down(silu(gate(x)) · up(x))``; the shared one is always on.

Experts run one at a time on all the tokens routed to them (a batched gather, not a loop over
tokens): correct and simple; fused grouped-GEMM kernels are what the fast engines add on GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dllm_serve.models.layers import MLP
from dllm_serve.models.transformer_config import MoEConfig

__all__ = ["FP32_PARAMETERS", "MoE", "Router", "route"]

# Parameters (suffixes of their names in DecoderTransformer) the loader keeps in fp32 whatever
# the model's dtype: routing is computed in fp32, and rounding the router to bf16 would move
# the near-tied scores that decide which experts run.
FP32_PARAMETERS = ("mlp.router.weight", "mlp.router.expert_bias")


def route(
    logits: torch.Tensor, expert_bias: torch.Tensor, cfg: MoEConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, top_k] fp32, expert ids [T, top_k])`` for router logits ``[T, E]``.

    Group-limited top-k on the biased sigmoid scores; weights from the unbiased scores (the
    module docstring has the math).
    """
    scores = logits.float().sigmoid()
    biased = scores + expert_bias.float()
    tokens = scores.shape[0]
    per_group = cfg.num_experts // cfg.n_group
    group_score = biased.view(tokens, cfg.n_group, per_group).topk(2, dim=-1).values.sum(-1)
    kept = group_score.topk(cfg.topk_group, dim=-1).indices
    keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, kept, True)
    # -inf, not 0: a biased score may be negative, and a dropped group must never win.
    eligible = biased.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
    ids = eligible.topk(cfg.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if cfg.renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids


class Router(nn.Module):
    """The gate: ``weight`` ``[E, d_model]`` and the selection-only ``expert_bias`` ``[E]``."""

    def __init__(self, d_model: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, d_model))
        self.expert_bias = nn.Parameter(torch.zeros(cfg.num_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``route`` of tokens ``x`` ``[T, d_model]``, logits computed in fp32."""
        logits = F.linear(x.float(), self.weight.float())
        return route(logits, self.expert_bias, self.cfg)


class MoE(nn.Module):
    """Routed SwiGLU experts plus always-on shared experts (see the module docstring)."""

    def __init__(self, d_model: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = Router(d_model, cfg)
        self.experts = nn.ModuleList(
            MLP(d_model, cfg.expert_hidden_size) for _ in range(cfg.num_experts)
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
        out = flat.new_empty(picks.shape[0], shape[-1])
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
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
