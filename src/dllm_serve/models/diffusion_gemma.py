"""DiffusionGemma's network: one Gemma-4 mixture-of-experts stack run in two modes.

.. code-block:: text

    encoder pass (causal; the prompt, then each committed canvas): writes K/V to the KV pool
        x = embed(ids) · √H
    decoder pass (bidirectional over the canvas; reads the cached prefix, keeps no K/V)
        x = post_norm( embed(ids) · √H + SC(soft) )         soft = softmax(prev logits / T) @ E · √H
                                                             (zeros on a canvas' first step)
    every layer (both modes; only the scalar differs)
        h = h + post_attn_norm( Attn( input_norm(h) ) )
        d = post_ff_norm_1( GeGLU( pre_ff_norm(h) ) )
        m = post_ff_norm_2( MoE( pre_ff_norm_2(h), routed on h ) )
        h = ( h + post_ff_norm(d + m) ) · layer_scalar[mode]
    logits = 30 · tanh( (norm(h) @ Eᵀ) / 30 )                (final-logit soft-capping, fp32)

Attention: q = rope(q_norm(q_proj x)), k = rope(k_norm(k_proj x)), v = v_norm(v_proj x) with a
weight-less v_norm; softmax scale 1 (the q/k norms absorb it). Full-attention layers have a
larger head and no ``v_proj``: V is the *raw* ``k_proj`` output through ``v_norm`` (K = V).
Sliding layers see the last ``sliding_window`` positions (the query's own included) in an
encoder pass; in a decoder pass they see the last ``sliding_window − 1`` cached prefix positions
and the whole canvas (transformers 5.25's sliding cache keeps ``sliding_window − 1`` keys).
RoPE: the sliding layers' default RoPE, the full layers' "proportional" RoPE (the first
``partial_rotary_factor · hd / 2`` frequencies ``θ^(−2i/hd)``, the rest zero: those dims pass
through). The router reads the raw residual: ``softmax(proj(rms(h) · scale · H^−½))``, top-k,
renormalised, times ``per_expert_scale``.

A decoder pass writes its canvas K/V into the request's slots past its committed prefix (the
SDPA groups read keys from the pool), positions ``[L, L + canvas)``; those slots are never
read as a prefix, and the commit pass (an encoder pass over the same positions) overwrites
them with the causal K/V that stay. So the committed cache is exactly what transformers'
read-only decoder leaves.

The KV pool has one slot layout for every layer (``TransformerConfig.n_kv_heads = 1``,
``head_dim`` = the widest layer's ``kv_heads · head_dim``); each layer views its first
``kv_heads · head_dim`` values as ``[kv_heads, head_dim]``.

Reference: transformers 5.25 ``modeling_diffusion_gemma.py`` (the parity tests compare
against it), ``docs/models.md``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dllm_serve.models.attention import AttnGroup, FlatBatch, RowInput, sdpa_by_group
from dllm_serve.models.errors import ModelLoadError
from dllm_serve.models.kv_pool import KVPool
from dllm_serve.models.layers import MLP, Embedding, activate, fused_linear
from dllm_serve.models.moe import MoE
from dllm_serve.models.sharding import TPShard, embed_local
from dllm_serve.models.transformer_config import MoEConfig, TransformerConfig

__all__ = [
    "DiffusionGemmaConfig",
    "DiffusionGemmaModel",
    "GemmaLayerSpec",
    "GemmaRope",
    "load_gemma_slice",
]


@dataclass(frozen=True)
class GemmaRope:
    """RoPE of one layer type: ``default`` (every dim) or ``proportional`` (the first
    ``partial_rotary_factor · head_dim / 2`` frequencies, denominator the full head dim)."""

    kind: str  # "default" | "proportional"
    theta: float
    partial_rotary_factor: float = 1.0

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """``[head_dim / 2]`` fp32 inverse frequencies (zeros for the dims that do not rotate):
        transformers' ``_compute_proportional_rope_parameters`` / default RoPE."""
        # On the CPU explicitly: the loader builds the network on the meta device.
        cpu = torch.device("cpu")
        if self.kind == "default":
            steps = torch.arange(0, head_dim, 2, dtype=torch.int64, device=cpu).float()
            return 1.0 / (self.theta ** (steps / head_dim))
        angles = int(self.partial_rotary_factor * head_dim // 2)
        steps = torch.arange(0, 2 * angles, 2, dtype=torch.int64, device=cpu).float()
        rotated = 1.0 / (self.theta ** (steps / head_dim))
        return torch.cat([rotated, torch.zeros(head_dim // 2 - angles, device=cpu)])


@dataclass(frozen=True)
class GemmaLayerSpec:
    """One layer's attention: sliding or full, its head size and K/V heads, K = V."""

    sliding: bool
    head_dim: int
    n_kv_heads: int
    k_eq_v: bool  # no v_proj: V is the raw k_proj output (the full-attention layers)
    rope: GemmaRope

    @property
    def kv_width(self) -> int:
        return self.n_kv_heads * self.head_dim


@dataclass(frozen=True)
class DiffusionGemmaConfig(TransformerConfig):
    """A :class:`TransformerConfig` whose pool fields describe the KV slot layout
    (``n_kv_heads = 1``, ``head_dim`` = the widest layer's K/V width; module docstring), plus
    Gemma-4's per-layer attention and DiffusionGemma's canvas."""

    layers: tuple[GemmaLayerSpec, ...] = ()
    sliding_window: int = 0
    final_logit_softcapping: float | None = None
    canvas_length: int = 256
    self_conditioning_size: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.layers) != self.n_layers:
            raise ValueError(f"{len(self.layers)} layer specs for {self.n_layers} layers")
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        for spec in self.layers:
            if self.n_heads % spec.n_kv_heads:
                raise ValueError(
                    f"num_attention_heads {self.n_heads} is not divisible by a layer's "
                    f"{spec.n_kv_heads} key/value heads"
                )

    def tp_fields(self, size: int) -> dict[str, Any]:
        """The fields a tensor-parallel rank of ``size`` holds beyond the shared ones
        (``sharding.shard_config`` merges them): each layer's K/V heads (divided, or one
        replicated head where a layer has fewer than ``size``: the full layers' single K = V
        head), the KV slot width of those local heads, and the self-conditioning MLP's width.
        Raises :class:`ModelLoadError` naming what does not divide."""
        layers = []
        for i, spec in enumerate(self.layers):
            kv = spec.n_kv_heads
            if kv % size and size % kv:
                raise ModelLoadError(
                    f"--tensor-parallel-size {size} and layer {i}'s {kv} KV heads: one must "
                    "divide the other"
                )
            layers.append(dataclasses.replace(spec, n_kv_heads=max(1, kv // size)))
        if self.self_conditioning_size % size:
            raise ModelLoadError(
                f"--tensor-parallel-size {size} does not divide the model's self-conditioning "
                f"width ({self.self_conditioning_size})"
            )
        return {
            "layers": tuple(layers),
            "n_kv_heads": 1,  # the pool's slot layout (module docstring), per rank
            "head_dim": max(spec.kv_width for spec in layers),
            "self_conditioning_size": self.self_conditioning_size // size,
        }


class GemmaRMSNorm(nn.Module):
    """Gemma-4 RMSNorm: normalise in fp32 and multiply by ``weight`` in fp32 (not Gemma-2/3's
    ``1 + weight``), cast back; ``with_weight=False``: no weight (v_norm, the router's norm)."""

    def __init__(self, dim: int, eps: float, with_weight: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim)) if with_weight else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else self.weight.float()
        return F.rms_norm(x.float(), (x.shape[-1],), weight, self.eps).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x · cos + rotate_half(x) · sin`` in fp32 (NeoX layout), back in ``x``'s dtype."""
    x32 = x.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


class GemmaAttention(nn.Module):
    """Gemma-4 attention of one layer (module docstring), on the flat batch's SDPA groups."""

    def __init__(self, config: DiffusionGemmaConfig, spec: GemmaLayerSpec) -> None:
        super().__init__()
        d, hd = config.d_model, spec.head_dim
        self.spec = spec
        self.n_heads = config.n_heads
        self.q_proj: nn.Linear | None = nn.Linear(d, config.n_heads * hd, bias=False)
        self.k_proj: nn.Linear | None = nn.Linear(d, spec.n_kv_heads * hd, bias=False)
        self.v_proj = None if spec.k_eq_v else nn.Linear(d, spec.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(config.n_heads * hd, d, bias=False)
        self.q_norm = GemmaRMSNorm(hd, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(hd, config.rms_norm_eps)
        self.eps = config.rms_norm_eps
        self.qkv_proj: nn.Linear | None = None  # after fuse(): q, k (and v) in one matmul

    def fuse(self) -> None:
        """Replace the q/k(/v) projections by one (same outputs, one matmul)."""
        if self.qkv_proj is None:
            parts = [self.q_proj, self.k_proj] + ([] if self.v_proj is None else [self.v_proj])
            self.qkv_proj = fused_linear([p for p in parts if p is not None])
            self.q_proj = self.k_proj = None
            self.v_proj = None

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[T, H, hd]``, k and v ``[T, Hkv, hd]`` (RoPE on q and k; v weight-less normed)."""
        hd, hkv = self.spec.head_dim, self.spec.n_kv_heads
        t = x.shape[0]
        if self.qkv_proj is not None:
            sizes = [self.n_heads * hd, hkv * hd] + ([] if self.spec.k_eq_v else [hkv * hd])
            parts = self.qkv_proj(x).split(sizes, dim=-1)
            q_out, k_out = parts[0], parts[1]
            v_out = None if self.spec.k_eq_v else parts[2]
        else:
            assert self.q_proj is not None and self.k_proj is not None
            q_out, k_out = self.q_proj(x), self.k_proj(x)
            v_out = None if self.v_proj is None else self.v_proj(x)
        q = _rotate(self.q_norm(q_out.view(t, self.n_heads, hd)), cos, sin)
        raw_k = k_out.view(t, hkv, hd)
        # K = V layers: V is the k_proj output *before* k_norm and RoPE.
        raw_v = raw_k if v_out is None else v_out.view(t, hkv, hd)
        k = _rotate(self.k_norm(raw_k), cos, sin)
        v = F.rms_norm(raw_v.float(), (hd,), None, self.eps).to(raw_v.dtype)
        return q, k, v

    def forward_flat(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: FlatBatch,
        pool_kv: tuple[torch.Tensor, torch.Tensor] | None,
        masks: list[tuple[torch.Tensor | None, bool]],
    ) -> torch.Tensor:
        """Attention of flat tokens ``x`` ``[T, D]``: K/V written at ``batch.slot_mapping`` in
        this layer's pool views, then one SDPA call per group with ``masks[g]`` (this layer
        type's mask and causal flag per group)."""
        q, k, v = self.project(x, cos, sin)
        pool_k = pool_v = None
        if pool_kv is not None and batch.slot_mapping is not None:
            pool_k, pool_v = pool_kv
            pool_k.index_copy_(0, batch.slot_mapping, k)
            pool_v.index_copy_(0, batch.slot_mapping, v)
        if len(masks) != len(batch.groups):
            raise ValueError("one (mask, causal) pair per attention group is needed")
        pool = None if pool_k is None or pool_v is None else (pool_k, pool_v)
        # Softmax scale 1, not 1/√d: the q/k norms absorb it (Gemma-4).
        attended = sdpa_by_group(
            q, k, v, batch.groups, pool, self.spec.head_dim, masks=masks, scale=1.0
        )
        return self.o_proj(attended)


class GemmaRouter(nn.Module):
    """Gemma-4's router: softmax over every expert of ``proj(rms(h) · scale · H^−½)`` in fp32,
    the top-k renormalised to sum 1, each times its expert's ``per_expert_scale``."""

    def __init__(self, d_model: int, cfg: MoEConfig, eps: float) -> None:
        super().__init__()
        self.cfg = cfg
        self.norm = GemmaRMSNorm(d_model, eps, with_weight=False)
        self.proj = nn.Linear(d_model, cfg.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(d_model))
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.num_experts))
        self.root = d_model**-0.5

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, top_k], expert ids [T, top_k])`` for residuals ``h`` ``[T, D]``."""
        scores = self.proj(self.norm(h) * self.scale * self.root)
        probs = scores.softmax(dim=-1, dtype=torch.float32)
        weights, ids = probs.topk(self.cfg.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids


class GemmaExperts(MoE):
    """The routed GeGLU experts, through :class:`MoE`'s grouped path once fused.

    The checkpoint stores them stacked (``gate_up_proj`` ``[E, 2I, D]``, gate rows first, and
    ``down_proj`` ``[E, D, I]``), so they load as two parameters in that layout and
    :meth:`fuse` turns them into :class:`MoE`'s input-major stacks (no per-expert modules).
    Under expert parallelism only this rank's experts (``cfg.local_experts``, from 0)."""

    def __init__(self, d_model: int, cfg: MoEConfig) -> None:
        nn.Module.__init__(self)
        self.cfg = cfg
        self.router = None  # routed by the layer's GemmaRouter (on the raw residual)
        self.experts = nn.ModuleList()
        self.shared = None
        self.gate_up: nn.Parameter | None = None
        self.down: nn.Parameter | None = None
        self.grouped_refused = False
        e, i = len(cfg.local_experts), cfg.expert_hidden_size
        self.gate_up_proj: nn.Parameter | None = nn.Parameter(torch.empty(e, 2 * i, d_model))
        self.down_proj: nn.Parameter | None = nn.Parameter(torch.empty(e, d_model, i))

    def fuse(self) -> None:
        if self.gate_up is not None:
            return
        assert self.gate_up_proj is not None and self.down_proj is not None
        with torch.no_grad():
            gate_up = self.gate_up_proj.transpose(1, 2).contiguous()  # [E, D, 2I]
            down = self.down_proj.transpose(1, 2).contiguous()  # [E, I, D]
        # The checkpoint layout is dropped: no weight is held twice.
        del self.gate_up_proj, self.down_proj
        self.gate_up_proj = self.down_proj = None
        self.gate_up = nn.Parameter(gate_up, requires_grad=False)
        self.down = nn.Parameter(down, requires_grad=False)
        self.grouped_refused = not self._grouped_mm_takes_the_weights()

    def _expert(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``i`` on ``x``: from the checkpoint layout before :meth:`fuse`, else stacked."""
        if self.gate_up is not None:
            return super()._expert(i, x)
        assert self.gate_up_proj is not None and self.down_proj is not None
        gate, up = F.linear(x, self.gate_up_proj[i]).chunk(2, dim=-1)
        return F.linear(activate(gate, self.cfg.activation) * up, self.down_proj[i])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - not routed here
        raise TypeError("GemmaExperts are called through mix() with the layer's routing")


class GemmaLayer(nn.Module):
    """One DiffusionGemma layer (module docstring): attention, then a dense GeGLU and the MoE
    side by side, then the mode's layer scalar on the whole output."""

    def __init__(self, config: DiffusionGemmaConfig, spec: GemmaLayerSpec) -> None:
        super().__init__()
        d, eps = config.d_model, config.rms_norm_eps
        assert config.moe is not None
        self.self_attn = GemmaAttention(config, spec)
        self.mlp = MLP(d, config.mlp_hidden_size, "gelu_tanh")
        self.router = GemmaRouter(d, config.moe, eps)
        self.experts = GemmaExperts(d, config.moe)
        for name in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
            "post_feedforward_layernorm_1",
            "post_feedforward_layernorm_2",
            "pre_feedforward_layernorm_2",
        ):
            self.add_module(name, GemmaRMSNorm(d, eps))
        # Two scalars, one per mode: the checkpoint stores them apart (decoder and encoder) and
        # transformers loads them apart, so a checkpoint whose two differ runs as trained.
        self.register_buffer("layer_scalar", torch.ones(1))
        self.register_buffer("encoder_layer_scalar", torch.ones(1))
        self.tp: TPShard | None = None  # tensor parallelism (set_tensor_parallel)

    def forward_flat(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: FlatBatch,
        pool_kv: tuple[torch.Tensor, torch.Tensor] | None,
        masks: list[tuple[torch.Tensor | None, bool]],
        decoder: torch.Tensor | bool,
    ) -> torch.Tensor:
        """``decoder``: True/False when every token is in one mode, else a ``[T, 1]`` bool."""
        attended = self.self_attn.forward_flat(
            self.input_layernorm(h), cos, sin, batch, pool_kv, masks
        )
        if self.tp is not None:  # row-parallel o_proj: a partial sum, completed before the norm
            self.tp.all_reduce(attended)
        h = h + self.post_attention_layernorm(attended)
        dense = self.mlp(self.pre_feedforward_layernorm(h))
        weights, ids = self.router(h)  # routed on the raw residual, not the normed input
        routed = self.experts.mix(self.pre_feedforward_layernorm_2(h), weights, ids)
        if self.tp is not None:
            # Both are partial sums (row-parallel down_proj; this rank's experts or expert
            # slices) and each is normed on its own, so both are completed first: in one
            # all-reduce of the two side by side rather than two.
            both = self.tp.all_reduce(torch.cat((dense, routed), dim=-1))
            dense, routed = both.split(h.shape[-1], dim=-1)
        dense = self.post_feedforward_layernorm_1(dense)
        h = h + self.post_feedforward_layernorm(dense + self.post_feedforward_layernorm_2(routed))
        if isinstance(decoder, bool):
            scalar = self.layer_scalar if decoder else self.encoder_layer_scalar
        else:
            scalar = torch.where(decoder, self.layer_scalar, self.encoder_layer_scalar)
        return h * scalar


class SelfConditioning(nn.Module):
    """``post_norm(e + down(gelu(gate(n)) · up(n)))`` with ``n = pre_norm(soft)``: the previous
    step's soft embedding fed back into the decoder's input (``post_norm`` has no weight)."""

    def __init__(self, d_model: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.pre_norm = GemmaRMSNorm(d_model, eps)
        self.post_norm = GemmaRMSNorm(d_model, eps, with_weight=False)
        self.mlp = MLP(d_model, hidden, "gelu_tanh")
        self.tp: TPShard | None = None  # the MLP is column/row-parallel under TP

    def forward(self, embeds: torch.Tensor, soft: torch.Tensor | None) -> torch.Tensor:
        if soft is None:  # the first step of a canvas: zeros in, zeros out (no biases)
            return self.post_norm(embeds)
        fed = self.mlp(self.pre_norm(soft))
        if self.tp is not None:  # row-parallel down_proj: complete the sum before the norm
            self.tp.all_reduce(fed)
        return self.post_norm(embeds + fed)


class DiffusionGemmaModel(nn.Module):
    """The DiffusionGemma text network (module docstring) behind the serving runtime's
    :class:`FlatBatch` interface: causal rows are encoder passes, bidirectional rows decoder
    passes; a decoder row's ``model_input`` is its self-conditioning soft embedding
    ``[canvas, d_model]`` (None on a canvas' first step).

    Tensor parallelism (:meth:`set_tensor_parallel`; built from ``sharding.shard_config``'s
    local config, weights from :func:`load_gemma_slice`): attention heads column-parallel on
    sliding and full layers alike (each rank its query heads and their K/V heads, a layer's
    K/V head replicated where it has fewer than the ranks, as the full layers' single K = V
    head), ``o_proj`` row-parallel; the dense GeGLU and the self-conditioning MLP gate/up
    column- and down row-parallel; the routed experts sliced like the MLP or split whole over
    the ranks (expert parallelism), the router replicated. Every partial sum is all-reduced
    before the norm that follows it (three all-reduces a layer: attention, and the dense and
    routed outputs together). The embedding is vocab-parallel (all-reduced), so the tied LM
    head gives this rank's vocabulary slice of the logits, soft-capped elementwise; the KV pool
    holds this rank's K/V heads."""

    needs_row_inputs = True  # the ModelRunner puts FlatBatch.row_inputs in every batch

    def __init__(self, config: DiffusionGemmaConfig) -> None:
        super().__init__()
        self.config = config
        d = config.d_model
        self.embed_tokens = Embedding(config.vocab_size, d)
        self.layers = nn.ModuleList(GemmaLayer(config, spec) for spec in config.layers)
        self.norm = GemmaRMSNorm(d, config.rms_norm_eps)
        sc = config.self_conditioning_size or config.mlp_hidden_size
        self.self_conditioning = SelfConditioning(d, sc, config.rms_norm_eps)
        self.embed_scale = math.sqrt(d)
        # fp32 frequencies per layer type, plain attributes (a buffer would be cast to bf16).
        self._inv_freq = {spec.sliding: spec.rope.inv_freq(spec.head_dim) for spec in config.layers}
        # The frequencies on each device they were asked for (one copy, not one per forward).
        self._inv_freq_on: dict[tuple[torch.device, bool], torch.Tensor] = {}
        self.tp: TPShard | None = None

    @staticmethod
    def keeps_fp32(name: str) -> bool:
        """No parameter stays fp32: transformers runs the router in the model's dtype too."""
        return False

    def set_tensor_parallel(self, shard: TPShard) -> None:
        """Make this (sharded) model one rank of a tensor-parallel group (class docstring)."""
        self.tp = shard
        for layer in self.layers:
            layer.tp = shard
        self.self_conditioning.tp = shard

    def fuse_projections(self) -> DiffusionGemmaModel:
        """Fuse the dense MLPs' gate/up and stack the experts for the grouped path."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
            layer.experts.fuse()
        self.self_conditioning.mlp.fuse()
        return self

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """``embed_tokens(ids) · √H``, the scale rounded to the weight's dtype (transformers);
        vocab-parallel under tensor parallelism (the rows summed over the ranks, exactly)."""
        weight = self.embed_tokens.weight
        if self.tp is None:
            rows = self.embed_tokens(ids)
        else:
            rows = embed_local(self.embed_tokens, ids, self.tp)
        return rows * torch.tensor(self.embed_scale, dtype=weight.dtype)

    def soft_embedding(self, probs: torch.Tensor) -> torch.Tensor:
        """The self-conditioning signal ``probs @ E · √H`` for probabilities ``[..., V]``
        (the previous step's tempered softmax), in the model's dtype (one process only: under
        tensor parallelism each rank holds ``V / N`` rows of ``E`` and the sampler sums
        :meth:`soft_product` over the ranks, then :meth:`soft_scale`)."""
        return self.soft_scale(self.soft_product(probs))

    def soft_product(self, probs: torch.Tensor) -> torch.Tensor:
        """``probs @ E`` over the embedding rows this process holds: probabilities ``[..., V_r]``
        of those vocabulary ids (all of them without tensor parallelism)."""
        weight = self.embed_tokens.weight
        return probs.to(weight.dtype) @ weight

    def soft_scale(self, product: torch.Tensor) -> torch.Tensor:
        """``product · √H`` in the model's dtype: the last factor of :meth:`soft_embedding`."""
        weight = self.embed_tokens.weight
        return product.to(weight.dtype) * torch.tensor(self.embed_scale, dtype=weight.dtype)

    def forward_flat(self, batch: FlatBatch, pool: KVPool | None = None) -> torch.Tensor:
        """Final-normed hidden states ``[N, D]`` at ``batch.logits_index``."""
        if batch.flex is not None or batch.row_inputs is None:
            raise ValueError("DiffusionGemma runs on the sdpa backend with per-row inputs")
        rows = batch.row_inputs
        x = self.embed(batch.input_ids)
        decoder = self._decoder_tokens(rows, x)
        if decoder is not False:
            x = self._self_condition(rows, x, decoder)
        masks = {sliding: self._masks(batch, rows, sliding) for sliding in (False, True)}
        tables = {
            sliding: self._rope(batch.positions, self._frequencies(sliding, x.device))
            for sliding in self._inv_freq
        }
        for i, layer in enumerate(self.layers):
            spec = layer.self_attn.spec
            cos, sin = tables[spec.sliding]
            x = layer.forward_flat(
                x, cos, sin, batch, self._pool_views(pool, i, spec), masks[spec.sliding], decoder
            )
        return self.norm(x.index_select(0, batch.logits_index))

    def lm_head(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Soft-capped fp32 logits ``cap · tanh(logits / cap)`` for hidden states ``[..., D]``."""
        if out is not None:
            raise ValueError("DiffusionGemma has no captured-graph path")
        logits = F.linear(hidden, self.embed_tokens.weight).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    # ---- the forward's pieces ------------------------------------------------------------------
    @staticmethod
    def _decoder_tokens(rows: list[RowInput], x: torch.Tensor) -> torch.Tensor | bool:
        """Which tokens are in decoder mode: a bool when all rows agree, else ``[T, 1]``."""
        kinds = {r.causal for r in rows}
        if len(kinds) == 1:
            return not kinds.pop()
        # Filled on the device row by row: no host→device copy inside the forward.
        flags = torch.zeros(x.shape[0], 1, dtype=torch.bool, device=x.device)
        for r in rows:
            if not r.causal:
                flags[r.offset : r.offset + r.length] = True
        return flags

    def _self_condition(
        self, rows: list[RowInput], x: torch.Tensor, decoder: torch.Tensor | bool
    ) -> torch.Tensor:
        """Decoder tokens' inputs through the self-conditioning block (encoder tokens as they
        are): each decoder row's soft embedding, zeros where it has none."""
        soft_parts = []
        any_soft = False
        for r in rows:
            soft = r.model_input if not r.causal else None
            if soft is None:
                soft_parts.append(x.new_zeros(r.length, x.shape[-1]))
            else:
                if tuple(soft.shape) != (r.length, x.shape[-1]):
                    raise ValueError(
                        f"a decoder row of {r.length} tokens got a self-conditioning input of "
                        f"shape {tuple(soft.shape)}"
                    )
                # to(device): under tensor parallelism a worker receives it with the step's rows.
                soft_parts.append(soft.to(device=x.device, dtype=x.dtype))
                any_soft = True
        soft_all = None
        if any_soft:
            soft_all = torch.cat(soft_parts) if len(soft_parts) > 1 else soft_parts[0]
        conditioned = self.self_conditioning(x, soft_all)
        if isinstance(decoder, bool):
            return conditioned
        return torch.where(decoder, conditioned, x)

    def _frequencies(self, sliding: bool, device: torch.device) -> torch.Tensor:
        key = (device, sliding)
        if key not in self._inv_freq_on:
            self._inv_freq_on[key] = self._inv_freq[sliding].to(device)
        return self._inv_freq_on[key]

    @staticmethod
    def _rope(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[T, 1, head_dim]`` (fp32) at ``positions``."""
        freqs = positions.float()[:, None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos(), emb.sin()

    @staticmethod
    def _pool_views(
        pool: KVPool | None, layer: int, spec: GemmaLayerSpec
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer ``layer``'s K and V in the pool as ``[slots, kv_heads, head_dim]`` views of the
        first ``kv_heads · head_dim`` values of each slot."""
        if pool is None:
            return None
        k, v = pool.k[layer], pool.v[layer]
        slots = k.shape[0]
        width = spec.kv_width
        shape = (slots, spec.n_kv_heads, spec.head_dim)
        return (
            k.view(slots, -1)[:, :width].view(shape),
            v.view(slots, -1)[:, :width].view(shape),
        )

    def _masks(
        self, batch: FlatBatch, rows: list[RowInput], sliding: bool
    ) -> list[tuple[torch.Tensor | None, bool]]:
        """Each SDPA group's ``(attn_mask, is_causal)`` for full or sliding layers.

        Full layers: the group's own mask. Sliding layers add the window: key position ``k``
        is visible iff ``k > anchor − W``, the anchor being the query's position in a causal
        (encoder) row and the row's first position in a bidirectional (decoder) row, so a
        canvas sees the last ``W − 1`` prefix positions and all of itself (transformers 5.25).
        """
        if not sliding:
            return [(g.mask, g.is_causal) for g in batch.groups]
        causal_at = {r.offset: r.causal for r in rows}
        window = self.config.sliding_window
        return [
            (self._sliding_mask(batch, g, causal_at[g.start], window), False) for g in batch.groups
        ]

    @staticmethod
    def _sliding_mask(batch: FlatBatch, g: AttnGroup, causal: bool, window: int) -> torch.Tensor:
        queries = batch.positions[g.start : g.end].view(g.rows, g.q_len)  # [rows, q]
        anchor = queries if causal else queries[:, :1].expand(-1, g.q_len)
        if g.kv_slots is None:  # the row's own tokens are its keys
            keys = queries[:, None, :]  # [rows, 1, q]
            visible = keys > (anchor - window)[:, :, None]
            if causal:
                visible &= keys <= queries[:, :, None]
            return visible[:, None]  # [rows, 1, q, q]
        cols = torch.arange(g.kv_slots.shape[1], device=queries.device)
        visible = (cols[None, None, :] > (anchor - window)[:, :, None])[:, None]  # [rows,1,q,S]
        if g.mask is not None:  # causal and/or the key columns past a shorter prefix
            visible = visible & g.mask
        return visible


def _gemma_kv_heads(spec: GemmaLayerSpec, shard: TPShard) -> tuple[int, int]:
    """``(first, count)`` of the K/V heads of layer ``spec`` that ``shard`` holds: an equal
    share, or the one head its query heads read where the layer has fewer heads than ranks."""
    kv, size = spec.n_kv_heads, shard.size
    if kv >= size:
        return shard.rank * (kv // size), kv // size
    return shard.rank // (size // kv), 1


def load_gemma_slice(
    handle: Any, tensor: str, ours: str, tcfg: TransformerConfig, shard: TPShard
) -> torch.Tensor:
    """This rank's part of checkpoint ``tensor`` (our parameter ``ours``, full config
    ``tcfg``) from an open safetensors ``handle``, reading only that part (the layout in
    :class:`DiffusionGemmaModel`'s docstring).

    Rows of q/k/v and of the MLPs' gate/up (dim 0), columns of ``o_proj`` and the down
    projections (dim 1), rows of the embedding; the stacked experts ``gate_up_proj``
    ``[E, 2I, D]`` (gate rows then up rows) and ``down_proj`` ``[E, D, I]`` by whole experts
    under expert parallelism, else the rank's ``I / N`` of each expert (its gate rows *and*
    its up rows). Everything else (norms, router, scalars) is whole on every rank."""
    assert isinstance(tcfg, DiffusionGemmaConfig)
    view = handle.get_slice(tensor)
    full = tuple(view.get_shape())
    rank, size = shard.rank, shard.size
    parts = ours.split(".")
    module = parts[-2] if ours.endswith(".weight") else parts[-1]

    def cut(whole: int) -> tuple[int, int]:
        part = whole // size
        return rank * part, (rank + 1) * part

    if ".experts." in ours:
        moe = tcfg.moe
        assert moe is not None
        if shard.expert_parallel:
            local = dataclasses.replace(moe, expert_ranks=(rank, size)).local_experts
            return view[local.start : local.stop]
        a, b = cut(moe.expert_hidden_size)
        if module == "gate_up_proj":
            i = moe.expert_hidden_size
            return torch.cat((view[:, a:b], view[:, i + a : i + b]), dim=1)
        return view[:, :, a:b]  # down_proj [E, D, I]
    if module in ("k_proj", "v_proj"):
        spec = tcfg.layers[int(parts[1])]
        first, count = _gemma_kv_heads(spec, shard)
        return view[first * spec.head_dim : (first + count) * spec.head_dim]
    if module in ("q_proj", "gate_proj", "up_proj", "embed_tokens"):
        a, b = cut(full[0])
        return view[a:b]
    if module in ("o_proj", "down_proj"):
        a, b = cut(full[1])
        return view[:, a:b]
    return handle.get_tensor(tensor)
