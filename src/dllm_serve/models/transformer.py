"""One compact decoder transformer shared by every supported family (LLaDA, Dream, I-DLM,
SDAR, LLaDA2, LLaDA-MoE, Fast-dLLM v2, Nemotron-Labs-Diffusion).

RMSNorm, rotary position embeddings (NeoX/HF-Llama ``rotate_half`` layout, optionally on the
first ``rotary_dim`` dims only), SwiGLU MLP or mixture of experts (``moe.py``) and
grouped-query attention (optional q/k/v biases for Qwen2, per-head q/k norm for Qwen3 and
LLaDA2; the layers are in ``layers.py``) through
``torch.nn.functional.scaled_dot_product_attention``.
Diffusion LMs differ from autoregressive ones mostly in *which* attention pattern they use, so
the pattern is always an input (a mask, or the flat batch's attention groups) and never implied
by the module.

Parameter names are this module's own (Llama-like); the ``families/`` package maps each
checkpoint format's tensor names onto them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dllm_serve.models.attention import FlatBatch
from dllm_serve.models.kv_pool import KVPool
from dllm_serve.models.layers import MLP, Attention, Embedding, RMSNorm
from dllm_serve.models.moe import FP32_PARAMETERS, MoE
from dllm_serve.models.rope import rope_frequencies, rotary_table
from dllm_serve.models.routing import routing_segments, routing_segments_padded
from dllm_serve.models.sharding import TPShard, embed_local
from dllm_serve.models.transformer_config import TransformerConfig

__all__ = ["Block", "DecoderTransformer", "TransformerConfig"]


class Block(nn.Module):
    """Pre-norm residual block: attention then MLP (dense, or mixture-of-experts for the
    layers ``config.moe`` routes)."""

    def __init__(self, config: TransformerConfig, index: int = 0) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.rms_norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.d_model, config.rms_norm_eps)
        self.mlp: MLP | MoE
        if config.moe is not None and config.moe.is_moe_layer(index):
            self.mlp = MoE(config.d_model, config.moe)
        else:
            self.mlp = MLP(config.d_model, config.mlp_hidden_size)
        self.tp: TPShard | None = None  # tensor parallelism (set_tensor_parallel)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None,
        q_scale: torch.Tensor | None = None,
        segments: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, attn_mask, q_scale)
        return x + self._mlp(self.mlp_norm(x), segments)

    def _mlp(self, x: torch.Tensor, segments: torch.Tensor | None) -> torch.Tensor:
        """The feed-forward; a block-routed MoE also gets the tokens' routing blocks."""
        if segments is not None and isinstance(self.mlp, MoE):
            return self.mlp(x, segments)
        return self.mlp(x)

    def forward_flat(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: FlatBatch,
        kv: tuple[KVPool, int] | None,
        q_scale: torch.Tensor | None = None,
        segments: torch.Tensor | None = None,
    ) -> torch.Tensor:
        attended = self.attn.forward_flat(self.attn_norm(x), cos, sin, batch, kv, q_scale)
        if self.tp is not None:  # row-parallel o_proj: each rank holds a partial sum
            self.tp.all_reduce(attended)
        x = x + attended
        mlp = self._mlp(self.mlp_norm(x), segments)
        if self.tp is not None:  # row-parallel down_proj
            self.tp.all_reduce(mlp)
        return x + mlp


class DecoderTransformer(nn.Module):
    """RMSNorm, RoPE (NeoX/HF-Llama style rotate_half, fp32 frequencies), SwiGLU MLP, GQA,
    optional q/k/v biases and q/k norm, attention through
    ``torch.nn.functional.scaled_dot_product_attention``.

    Two entry points: :meth:`forward` takes padded rows ``[B, L]`` and an explicit mask (the
    training objectives and the reference tests use it), :meth:`forward_flat` takes the
    serving runtime's :class:`FlatBatch` (real tokens only, attention per group, K/V in a
    :class:`KVPool`). Both return final-normed hidden states; the LM head is a separate call so
    callers pay for the (large) vocabulary projection only where they need it.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.rms_norm_eps)
        # Tied checkpoints reuse the embedding matrix, so there is no separate parameter.
        self.head = (
            None
            if config.tie_embeddings
            else nn.Linear(config.d_model, config.vocab_size, bias=False)
        )
        # A plain attribute, not a buffer: ``module.to(bfloat16)`` would cast a buffer, and the
        # frequencies must stay fp32 (LLaDA's ``rope_full_precision``; HF computes them in fp32).
        # Partial RoPE builds its frequencies for the rotated width only (HF, SGLang).
        self._inv_freq, self._rope_factor = rope_frequencies(
            config.rotary_dim, config.rope_theta, config.rope_scaling
        )
        self._rope_tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self.tp: TPShard | None = None

    def set_tensor_parallel(self, shard: TPShard) -> None:
        """Make this (sharded) model one rank of a tensor-parallel group: the flat forward
        all-reduces after each row-parallel layer and embeds vocab-parallel; the LM head then
        gives this rank's vocabulary slice of the logits (``models/sharding.py``)."""
        self.tp = shard
        for layer in self.layers:
            layer.tp = shard

    @staticmethod
    def keeps_fp32(name: str) -> bool:
        """Whether parameter ``name`` stays fp32 in a half-precision model (the MoE router)."""
        return name.endswith(FP32_PARAMETERS)

    def fuse_projections(self) -> DecoderTransformer:
        """Fuse q/k/v and gate/up projections (for serving; same outputs, fewer kernels)."""
        for layer in self.layers:
            layer.attn.fuse()
            layer.mlp.fuse()
        return self

    def rope(
        self, positions: torch.Tensor, max_position: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[*positions.shape, 1, rotary_dim]`` (fp32) looked up in a cached table.

        The table covers the model's context and grows (doubling) when a position past it is
        asked for: an I-DLM round places its masks a few positions past the answer's last one.
        ``max_position`` (the largest position, when the caller knows it on the host) avoids
        reading it from the device.
        """
        if max_position is None:
            max_position = int(positions.max()) if positions.numel() else 0
        tables = self._rope_tables.get(positions.device)
        if tables is None or tables[0].shape[0] <= max_position:
            length = max(self.config.max_sequence_length, 1)
            while length <= max_position:
                length *= 2
            cos, sin = rotary_table(length, self._inv_freq, self._rope_factor)
            tables = self._rope_tables[positions.device] = (
                cos.to(positions.device),
                sin.to(positions.device),
            )
        cos, sin = tables
        return cos[positions].unsqueeze(-2), sin[positions].unsqueeze(-2)

    @property
    def routing_block(self) -> int:
        """The routing block of a block-routed MoE (LLaDA2.2's ``expert_capacity``), else 0."""
        moe = self.config.moe
        return moe.routing_block if moe is not None and moe.expert_capacity is not None else 0

    def query_scale(self, positions: torch.Tensor) -> torch.Tensor | None:
        """Llama-4 query factors ``[*positions.shape, 1, 1]`` (fp32), or None when the
        config has no query scaling (every other family)."""
        scale = self.config.query_scale
        if scale is None:
            return None
        return scale.factors(positions)[..., None, None]

    def forward(
        self,
        input_ids: torch.LongTensor,
        positions: torch.LongTensor,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [B, L, D] after the final norm.

        ``positions`` [B, L] are the rotary positions of each token. ``attn_mask`` is a bool
        [B, 1, L, L] tensor (True = query may attend to key) or None for full bidirectional
        attention.
        """
        if input_ids.shape != positions.shape:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} differ"
            )
        if attn_mask is not None:
            if attn_mask.dtype != torch.bool:
                raise TypeError(f"attn_mask must be bool, got {attn_mask.dtype}")
            # A query row with no visible key makes SDPA return NaN for it; that NaN would
            # then leak into every other row through the next layer's values (0 * NaN = NaN).
            # Such rows are padding by construction, so let them see everything instead.
            attn_mask = attn_mask | ~attn_mask.any(dim=-1, keepdim=True)
        cos, sin = self.rope(positions)
        q_scale = self.query_scale(positions)
        x = self.embed_tokens(input_ids)
        block = self.routing_block
        segments = routing_segments_padded(positions, block) if block else None
        for layer in self.layers:
            x = layer(x, cos, sin, attn_mask, q_scale, segments)
        return self.norm(x)

    def forward_flat(self, batch: FlatBatch, pool: KVPool | None = None) -> torch.Tensor:
        """Final-normed hidden states ``[N, D]`` at ``batch.logits_index`` only.

        K/V of every token are written to ``pool`` at ``batch.slot_mapping`` (when given)
        before attention reads them, so a group's keys may be gathered from the pool.
        """
        cos, sin = self.rope(batch.positions, batch.max_position)
        q_scale = self.query_scale(batch.positions)
        ids = batch.input_ids
        x = (
            self.embed_tokens(ids)
            if self.tp is None
            else embed_local(self.embed_tokens, ids, self.tp)
        )
        segments = None
        if self.routing_block:  # block routing: each token's routing block, once per forward
            if batch.row_offsets is None:
                raise ValueError("a block-routed MoE needs the flat batch's row offsets")
            segments = routing_segments(batch.positions, batch.row_offsets, self.routing_block)
        for i, layer in enumerate(self.layers):
            kv = None if pool is None else (pool, i)
            x = layer.forward_flat(x, cos, sin, batch, kv, q_scale, segments)
        # The norm is per token: select first, normalise only what the LM head will read.
        return self.norm(x.index_select(0, batch.logits_index))

    def lm_head(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [..., vocab_size] for hidden states [..., D] (into ``out`` when given: a
        captured graph's logits buffer)."""
        weight = self.embed_tokens.weight if self.head is None else self.head.weight
        if out is None:
            return F.linear(hidden, weight)
        return torch.matmul(hidden, weight.t(), out=out)
