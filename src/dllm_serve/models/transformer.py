"""One compact decoder transformer shared by every supported family.

RMSNorm, rotary position embeddings (NeoX/HF-Llama ``rotate_half`` layout), SwiGLU MLP and
grouped-query attention through ``torch.nn.functional.scaled_dot_product_attention`` with an
explicit mask. Diffusion LMs differ from autoregressive ones mostly in *which* mask they use,
so the mask is always an argument and never implied by the module.

Parameter names are this module's own (Llama-like); ``families.py`` maps each checkpoint
format's tensor names onto them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TransformerConfig:
    """Shape and numerics of a :class:`DecoderTransformer`, independent of checkpoint format."""

    vocab_size: int  # rows of the embedding / LM head (LLaDA: embedding_size)
    d_model: int
    n_heads: int
    n_kv_heads: int
    n_layers: int
    mlp_hidden_size: int
    rope_theta: float
    rms_norm_eps: float
    tie_embeddings: bool
    max_sequence_length: int

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class RMSNorm(nn.Module):
    """Root-mean-square norm; the variance is taken in fp32 and cast back before the weight."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Matches LLaDA and HF Llama: normalise in fp32, cast to the input dtype, then scale.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotary_tables(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape [B, 1, L, head_dim] in fp32 for integer ``positions`` [B, L].

    Computed per forward instead of cached in a buffer: ``module.to(bfloat16)`` would silently
    cast a float buffer, and the frequencies must stay fp32 (LLaDA's ``rope_full_precision``).
    """
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32)
    inv_freq = 1.0 / (theta ** (exponents / head_dim))
    freqs = positions.to(torch.float32)[..., None] * inv_freq  # [B, L, head_dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # halves layout, not interleaved
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, H, L, hd] in fp32 and return it in its own dtype."""
    x32 = x.float()
    return (x32 * cos + _rotate_half(x32) * sin).to(x.dtype)


class Embedding(nn.Embedding):
    """``nn.Embedding`` that skips random init on the meta device.

    The loader builds the network on ``meta`` and assigns checkpoint tensors; ``normal_`` has no
    meta kernel and its Python fallback costs a one-off ~2 s import of ``torch._dynamo``.
    """

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class Attention(nn.Module):
    """Multi-head attention with grouped key/value heads and no biases."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        hd = config.head_dim
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = hd
        self.q_proj = nn.Linear(config.d_model, config.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(config.d_model, config.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(config.d_model, config.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(config.n_heads * hd, config.d_model, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        b, length, _ = x.shape
        q = self.q_proj(x).view(b, length, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, length, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, length, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        if self.n_kv_heads != self.n_heads:
            # Query head h reads kv head h // n_rep (the HF/LLaDA ``repeat_kv`` convention).
            n_rep = self.n_heads // self.n_kv_heads
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=False)
        return self.o_proj(out.transpose(1, 2).reshape(b, length, -1))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.d_model, config.mlp_hidden_size, bias=False)
        self.up_proj = nn.Linear(config.d_model, config.mlp_hidden_size, bias=False)
        self.down_proj = nn.Linear(config.mlp_hidden_size, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm residual block: attention then MLP."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.rms_norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.d_model, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, attn_mask)
        return x + self.mlp(self.mlp_norm(x))


class DecoderTransformer(nn.Module):
    """RMSNorm, RoPE (NeoX/HF-Llama style rotate_half, fp32 frequencies), SwiGLU MLP, GQA,
    attention through ``torch.nn.functional.scaled_dot_product_attention`` with an explicit mask.

    ``forward`` returns the final-normed hidden states; the LM head is a separate call so that
    callers pay for the (large) vocabulary projection only at the positions they need.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.rms_norm_eps)
        # Tied checkpoints reuse the embedding matrix, so there is no separate parameter.
        self.head = (
            None
            if config.tie_embeddings
            else nn.Linear(config.d_model, config.vocab_size, bias=False)
        )

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
        cos, sin = rotary_tables(positions, self.config.head_dim, self.config.rope_theta)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, attn_mask)
        return self.norm(x)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [..., vocab_size] for hidden states [..., D]."""
        weight = self.embed_tokens.weight if self.head is None else self.head.weight
        return F.linear(hidden, weight)
