"""The mixture-of-experts feed-forward of LLaDA2.x and LLaDA-MoE.

.. code-block:: text

    (w, chosen) = route(x)                       models/routing.py, in fp32
    y = Σ_{i ∈ chosen} w_i · expert_i(x) + shared(x)

Every expert and the optional shared expert is a SwiGLU ``down(silu(gate(x)) · up(x))``; the
shared one is always on. The routing rule (LLaDA2's sigmoid group-limited top-k, or
LLaDA-MoE's softmax top-k) is pluggable through ``MoEConfig.routing``.

The computation is grouped by expert: the (token, slot) picks are sorted by expert id, every
expert runs once on its contiguous run of picks, and each token's ``top_k`` outputs are summed
in slot order. Once the serving runtime has fused the model (:meth:`MoE.fuse`), the experts'
weights are stacked into ``[E, ·, ·]`` tensors and the runs go through ``torch._grouped_mm``:
two grouped GEMMs over every expert, with the run boundaries computed on the device, so a MoE
layer reads nothing back to the host (a CUDA step keeps its one device→host copy). Where
that op refuses the weights (checked once in :meth:`MoE.fuse`: CUDA only takes bf16; older
torch has no CPU kernel) and under expert parallelism, the experts run one matmul each, which
needs the per-expert counts on the host: one read per layer. On one CPU thread both give
bitwise the same outputs (tested).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from dllm_serve.models.layers import MLP, activate
from dllm_serve.models.routing import route
from dllm_serve.models.transformer_config import MoEConfig

__all__ = ["FP32_PARAMETERS", "MoE", "Router", "route"]

logger = logging.getLogger(__name__)
# A device failing (raised), told apart from the grouped op refusing its inputs (a fallback).
# AcceleratorError (CUDA faults) is newer than the oldest torch this package supports.
_DEVICE_FAULTS: tuple[type[BaseException], ...] = tuple(
    getattr(torch, name)
    for name in ("OutOfMemoryError", "AcceleratorError")
    if hasattr(torch, name)
)
# Why torch._grouped_mm refused some layer's weights (device, dtype, message): logged once each.
_LOGGED_REFUSALS: set[tuple[str, torch.dtype, str]] = set()

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

    def forward(
        self, x: torch.Tensor, segments: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``route`` of tokens ``x`` ``[T, d_model]``, logits computed in fp32 (``segments``:
        each token's routing block, for block routing)."""
        logits = F.linear(x.float(), self.weight.float())
        return route(logits, self.expert_bias, self.cfg, segments)


class MoE(nn.Module):
    """Routed SwiGLU experts plus an optional always-on shared expert (module docstring)."""

    def __init__(self, d_model: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = Router(d_model, cfg)
        # Under expert parallelism only this rank's experts (cfg.local_experts), indexed from 0.
        self.experts = nn.ModuleList(
            MLP(d_model, cfg.expert_hidden_size, cfg.activation) for _ in cfg.local_experts
        )
        self.shared = MLP(d_model, cfg.shared_hidden_size) if cfg.shared_hidden_size else None
        # After fuse(): every local expert's fused gate-up ``[E, D, 2H]`` and down ``[E, H, D]``
        # weights, stacked input-major (``x @ w``; the per-expert modules are then dropped, so
        # no weight is held twice).
        self.gate_up: nn.Parameter | None = None
        self.down: nn.Parameter | None = None
        # Set by fuse() when torch._grouped_mm refuses this layer's weights (CUDA takes bf16
        # only, 16-byte aligned rows; an older torch has no CPU kernel): its experts then run
        # one by one.
        self.grouped_refused = False

    def fuse(self) -> None:
        """Fuse the gate and up projections (same outputs, fewer kernels) and stack the
        experts' weights for the grouped forward (module docstring). Call it on the device and
        in the dtype the layer will run in: it checks there that the grouped op takes them."""
        if self.shared is not None:
            self.shared.fuse()
        if self.gate_up is not None:
            return
        for expert in self.experts:
            expert.fuse()
        with torch.no_grad():
            # [out, in] nn.Linear weights → [in, out]: contiguous rows for every GEMM that
            # reads them (the CPU grouped kernel is a quarter slower on transposed views).
            gate_up = torch.stack([e.gate_up_proj.weight.t() for e in self.experts])  # type: ignore[union-attr]
            down = torch.stack([e.down_proj.weight.t() for e in self.experts])
        self.gate_up = nn.Parameter(gate_up, requires_grad=False)
        self.down = nn.Parameter(down, requires_grad=False)
        self.experts = nn.ModuleList()
        self.grouped_refused = not self._grouped_mm_takes_the_weights()

    def _grouped_mm_takes_the_weights(self) -> bool:
        """Whether ``torch._grouped_mm`` runs on these stacked weights (their device, dtype and
        row alignment): one tiny call per weight at load, so that serving never meets a refusal
        mid-forward; a refusal is logged once per cause."""
        assert self.gate_up is not None and self.down is not None
        experts, d_model, hidden = self.down.shape[0], self.down.shape[2], self.down.shape[1]
        if not hasattr(torch, "_grouped_mm"):
            why = "this torch has no torch._grouped_mm"
        else:
            like = self.gate_up
            ends = torch.arange(1, experts + 1, dtype=torch.int32, device=like.device)
            try:  # one row per expert through both GEMMs, shaped as the forward's inputs
                with torch.no_grad():
                    torch._grouped_mm(like.new_zeros(experts, d_model), self.gate_up, offs=ends)
                    torch._grouped_mm(like.new_zeros(experts, hidden), self.down, offs=ends)
                return True
            except _DEVICE_FAULTS:
                raise  # the device failing, not the op refusing these inputs
            except (NotImplementedError, RuntimeError) as exc:
                # The op's refusal of a dtype, device or row alignment (CUDA's takes bf16 and
                # 16-byte-aligned rows only): not an error of the model, which then runs the
                # equivalent one-by-one path, and says so.
                why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        cause = (self.gate_up.device.type, self.gate_up.dtype, why)
        if cause not in _LOGGED_REFUSALS:
            _LOGGED_REFUSALS.add(cause)
            logger.warning(
                "MoE on %s %s: torch._grouped_mm refuses the experts' weights (%s); they run "
                "one by one (same outputs, slower: their token counts are read on the host "
                "once per layer)", *cause,
            )  # fmt: skip
        return False

    @property
    def capturable(self) -> bool:
        """Whether a forward reads nothing back to the host (the grouped path): what a captured
        CUDA graph needs. The one-by-one path reads each expert's count."""
        stacked = self.gate_up is not None and self.down is not None
        everyone = len(self.cfg.local_experts) == self.cfg.num_experts
        return stacked and everyone and not self.grouped_refused

    def forward(self, x: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
        """The layer on ``x`` ``[..., D]``; ``segments`` ``[T]`` (flattened tokens): each
        token's routing block, which block routing (``cfg.expert_capacity``) needs."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, ids = self.router(flat, segments)
        y = self.mix(flat, weights, ids)
        if self.shared is not None:
            y = y + self.shared(flat)
        return y.view(shape)

    def mix(self, flat: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``Σ_i w_i · expert_i(x)`` for tokens ``flat`` ``[T, D]`` routed to experts ``ids``
        ``[T, top_k]`` with weights ``weights`` ``[T, top_k]`` (the routed part of the layer,
        without the shared expert; a family with its own router calls it directly)."""
        k = self.cfg.top_k
        # Sort the (token, slot) picks by expert: each expert then reads one contiguous run.
        picks = ids.flatten()
        order = picks.argsort(stable=True)
        out = self._grouped(flat, picks, order)
        if out is None:
            out = self._one_by_one(flat, picks, order)
        # Combine in fp32, each token's k outputs in slot order: the same sum however the
        # batch is composed (no atomics), so a request's tokens do not depend on its neighbours.
        routed = (out.view(-1, k, flat.shape[-1]).float() * weights.unsqueeze(-1)).sum(1)
        return routed.to(flat.dtype)

    def _grouped(
        self, flat: torch.Tensor, picks: torch.Tensor, order: torch.Tensor
    ) -> torch.Tensor | None:
        """Every expert's run in two grouped GEMMs, nothing read back; None where the layer is
        not fused, holds only some experts, or the grouped op refused its weights at fuse()."""
        if not self.capturable:
            return None
        assert self.gate_up is not None and self.down is not None
        # Run ends per expert, counted on the device (bincount would read its max back).
        counts = torch.zeros(self.cfg.num_experts, dtype=torch.long, device=flat.device)
        ends = counts.scatter_add_(0, picks, torch.ones_like(picks)).cumsum(0).to(torch.int32)
        rows = flat[order // self.cfg.top_k]
        hidden = torch._grouped_mm(rows, self.gate_up, offs=ends)
        gate, up = hidden.chunk(2, dim=-1)
        sorted_out = torch._grouped_mm(
            activate(gate, self.cfg.activation) * up, self.down, offs=ends
        )
        # Back to (token, slot) order: row j of the sorted runs is pick order[j].
        return torch.empty_like(sorted_out).index_copy_(0, order, sorted_out)

    def _one_by_one(
        self, flat: torch.Tensor, picks: torch.Tensor, order: torch.Tensor
    ) -> torch.Tensor:
        """One matmul per expert that received picks: the counts are read on the host."""
        k, shape = self.cfg.top_k, flat.shape
        counts = torch.bincount(picks, minlength=self.cfg.num_experts).tolist()  # one sync
        local = self.cfg.local_experts
        # Under expert parallelism the picks of other ranks' experts stay zero here: each rank
        # returns a partial sum, which the tensor-parallel all-reduce completes.
        out = (flat.new_zeros if len(local) < len(counts) else flat.new_empty)(
            picks.shape[0], shape[-1]
        )
        start = sum(counts[: local.start])
        for i, count in enumerate(counts[local.start : local.stop]):
            if count:
                rows = order[start : start + count]
                out[rows] = self._expert(i, flat[rows // k])
                start += count
        return out

    def _expert(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert ``i`` on ``x`` (from the stacked weights once fused)."""
        if self.gate_up is None or self.down is None:
            return self.experts[i](x)
        gate, up = (x @ self.gate_up[i]).chunk(2, dim=-1)
        return (activate(gate, self.cfg.activation) * up) @ self.down[i]
