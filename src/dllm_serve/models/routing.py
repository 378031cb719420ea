"""Mixture-of-experts routing: which ``top_k`` experts each token runs, and with what weight.

Two rules, picked by :attr:`MoEConfig.routing`; both take router logits ``[T, E]`` (computed
in fp32 by the caller) and return ``(weights [T, top_k] fp32, expert ids [T, top_k])``.

``"sigmoid_group_limited"`` (LLaDA2.x; Ling 2.0 / BailingMoeV2 lineage), over ``E`` experts in
``G`` equal groups:

.. code-block:: text

    s      = sigmoid(logits)                     [E]  the scores
    b      = s + expert_bias                     [E]  used only to *choose* experts
    g_j    = sum of the 2 largest b in group j   [G]
    kept   = the topk_group groups with the largest g_j
    chosen = the top_k experts by b among the kept groups' experts
    w_i    = s_i / (Σ_{c ∈ chosen} s_c + 1e-20) · routed_scaling_factor      (i ∈ chosen)

The bias (learned for load balancing) changes *which* experts run but never their weight;
the division is ``renormalize`` (``norm_topk_prob``).

``"softmax"`` (LLaDA-MoE; OLMoE lineage):

.. code-block:: text

    p      = softmax(logits)                     [E]  over all experts
    chosen = the top_k experts by p
    w_i    = p_i                                 (i ∈ chosen)
    w_i    = p_i / Σ_{c ∈ chosen} p_c            only with renormalize
    w_i    = w_i · routed_scaling_factor

Without renormalisation the chosen weights sum to less than one: the MoE output is scaled
down by the probability mass of the experts that were not chosen, as the model was trained.
"""

from __future__ import annotations

import torch

from dllm_serve.models.transformer_config import MoEConfig

__all__ = ["route", "sigmoid_group_limited", "softmax_topk"]


def sigmoid_group_limited(
    logits: torch.Tensor, expert_bias: torch.Tensor, cfg: MoEConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-limited top-k on the biased sigmoid scores; weights from the unbiased scores."""
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


def softmax_topk(logits: torch.Tensor, cfg: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in fp32, then the ``top_k`` largest probabilities."""
    probs = logits.float().softmax(dim=-1)
    weights, ids = probs.topk(cfg.top_k, dim=-1)
    if cfg.renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights * cfg.routed_scaling_factor, ids


def route(
    logits: torch.Tensor, expert_bias: torch.Tensor | None, cfg: MoEConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, top_k] fp32, expert ids [T, top_k])`` by ``cfg.routing`` (see above)."""
    if cfg.routing == "softmax":
        return softmax_topk(logits, cfg)
    assert expert_bias is not None, "sigmoid group-limited routing needs the expert bias"
    return sigmoid_group_limited(logits, expert_bias, cfg)
