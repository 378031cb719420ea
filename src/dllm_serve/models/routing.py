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

**Block routing** (LLaDA2.2, ``expert_capacity`` C): the sigmoid rule's selection scores
``b`` (as above), but experts are first admitted per *routing block* — the tokens of one
request whose positions fall in one block of ``routing_block`` positions aligned to position 0
(the checkpoint's ``block_size``):

.. code-block:: text

    g_j      = max over the block's tokens t of b_t[j]        [E]  admission score
    admitted = the C experts with the largest g_j
    chosen_t = the top_k experts by b_t among the admitted ones  (per token)
    w_i      = s_i / (Σ_{c ∈ chosen_t} s_c + 1e-20) · routed_scaling_factor

so a block touches at most C experts (instead of up to ``min(B · top_k, E)``). The admission
replaces the expert-group limit: the only constraint stated for the kernel that serves these
checkpoints is ``top_k ≤ C ≤ E``, which a group limit inside the admitted pool could not
honour (a kept group may hold fewer than ``top_k`` admitted experts). With ``C ≥ E`` every
expert is admitted and the rule is plain top-k on ``b``.
"""

from __future__ import annotations

import torch

from dllm_serve.models.transformer_config import MoEConfig

__all__ = [
    "block_routed",
    "route",
    "routing_segments",
    "routing_segments_padded",
    "sigmoid_group_limited",
    "softmax_topk",
]


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


def block_routed(
    logits: torch.Tensor, expert_bias: torch.Tensor, cfg: MoEConfig, segments: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block routing (module docstring): token ``t`` belongs to routing block ``segments[t]``
    (``[T]`` ids in ``[0, T)``; tokens of one id share their admitted experts).

    Device ops only, nothing read back: the admission table has one row per possible id
    (``T`` rows, the unused ones stay ``-inf`` and are never gathered)."""
    assert cfg.expert_capacity is not None
    scores = logits.float().sigmoid()
    biased = scores + expert_bias.float()
    tokens, experts = biased.shape
    admission = biased.new_full((tokens, experts), float("-inf")).scatter_reduce_(
        0, segments[:, None].expand(-1, experts), biased, reduce="amax"
    )
    capacity = min(cfg.expert_capacity, experts)
    kept = admission.topk(capacity, dim=-1).indices
    admitted = torch.zeros_like(admission, dtype=torch.bool).scatter_(1, kept, True)
    # -inf, not 0: a biased score may be negative, and an expert not admitted must never win.
    eligible = biased.masked_fill(~admitted.index_select(0, segments), float("-inf"))
    ids = eligible.topk(cfg.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if cfg.renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids


def routing_segments(
    positions: torch.Tensor, row_offsets: torch.Tensor, block: int
) -> torch.Tensor:
    """Routing-block ids ``[T]`` of a flat batch: a new block starts at each row's first token
    (``row_offsets``, the flat index of every row's first token; rows are different requests,
    or different passes of one) and wherever a position is a multiple of ``block``. Device
    ops only. A row's block that began in an earlier forward (its cached part) is not seen:
    the block-diffusion rows always hold whole blocks, so none does."""
    starts = positions.remainder(block) == 0
    starts = starts.index_fill(0, row_offsets, True)
    return starts.long().cumsum(0) - 1


def routing_segments_padded(positions: torch.Tensor, block: int) -> torch.Tensor:
    """Routing-block ids ``[B * L]`` of padded rows ``positions`` ``[B, L]`` (each row its own
    request; padding tokens take part in their block's admission, so a caller pads whole
    blocks only)."""
    rows, length = positions.shape
    flat = positions.reshape(-1)
    offsets = torch.arange(rows, device=flat.device) * length
    return routing_segments(flat, offsets, block) if flat.numel() else flat


def route(
    logits: torch.Tensor,
    expert_bias: torch.Tensor | None,
    cfg: MoEConfig,
    segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, top_k] fp32, expert ids [T, top_k])`` by ``cfg.routing`` (see above);
    block routing (``cfg.expert_capacity``) needs each token's routing block ``segments``."""
    if cfg.expert_capacity is not None:
        if segments is None:
            raise ValueError("block routing (expert_capacity) needs the tokens' routing blocks")
        assert expert_bias is not None, "block routing needs the expert bias"
        return block_routed(logits, expert_bias, cfg, segments)
    if cfg.routing == "softmax":
        return softmax_topk(logits, cfg)
    assert expert_bias is not None, "sigmoid group-limited routing needs the expert bias"
    return sigmoid_group_limited(logits, expert_bias, cfg)
