"""One compact decoder transformer shared by every supported family (LLaDA, Dream, I-DLM).

RMSNorm, rotary position embeddings (NeoX/HF-Llama ``rotate_half`` layout), SwiGLU MLP and
grouped-query attention (optional q/k/v biases for Qwen2, per-head q/k norm for Qwen3) through
``torch.nn.functional.scaled_dot_product_attention`` with an explicit mask, optionally over a
cached key/value prefix. Diffusion LMs differ from autoregressive ones mostly in *which* mask
they use, so the mask is always an argument and never implied by the module.

Parameter names are this module's own (Llama-like); ``families.py`` maps each checkpoint
format's tensor names onto them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dllm_serve.models.kv_cache import KVBatch
from dllm_serve.models.rope import RopeScaling, apply_rotary, rope_frequencies, rotary_tables


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
    head_dim: int = 0  # 0: d_model // n_heads (Qwen3 may set it independently)
    qkv_bias: bool = False  # Qwen2/Dream: biases on q/k/v
    o_bias: bool = False  # Qwen3 attention_bias=true: biases on q/k/v *and* o
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before RoPE
    rope_scaling: RopeScaling | None = None  # None: plain RoPE with rope_theta

    def __post_init__(self) -> None:
        if not self.head_dim:
            if self.d_model % self.n_heads:
                raise ValueError(
                    f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}"
                )
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")


class RMSNorm(nn.Module):
    """Root-mean-square norm; the variance is taken in fp32 and cast back before the weight."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Matches LLaDA and HF Llama/Qwen: normalise in fp32, cast to the input dtype, then scale.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Embedding(nn.Embedding):
    """``nn.Embedding`` that skips random init on the meta device.

    The loader builds the network on ``meta`` and assigns checkpoint tensors; ``normal_`` has no
    meta kernel and its Python fallback costs a one-off ~2 s import of ``torch._dynamo``.
    """

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class Attention(nn.Module):
    """Grouped-query attention; optional q/k/v (and o) biases and per-head q/k RMSNorm."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        hd = config.head_dim
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = hd
        qkv_bias = config.qkv_bias or config.o_bias
        self.q_proj = nn.Linear(config.d_model, config.n_heads * hd, bias=qkv_bias)
        self.k_proj = nn.Linear(config.d_model, config.n_kv_heads * hd, bias=qkv_bias)
        self.v_proj = nn.Linear(config.d_model, config.n_kv_heads * hd, bias=qkv_bias)
        self.o_proj = nn.Linear(config.n_heads * hd, config.d_model, bias=config.o_bias)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(hd, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None,
        kv: tuple[KVBatch, int] | None = None,
    ) -> torch.Tensor:
        b, length, _ = x.shape
        q = self.q_proj(x).view(b, length, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(b, length, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, length, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # Qwen3: per head, before RoPE
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        if kv is not None:
            cache, layer = kv
            cache.write(layer, k, v)
            past_k, past_v = cache.read(layer, k)
            k, v = torch.cat((past_k, k), dim=2), torch.cat((past_v, v), dim=2)
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
        kv: tuple[KVBatch, int] | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, attn_mask, kv)
        return x + self.mlp(self.mlp_norm(x))


class DecoderTransformer(nn.Module):
    """RMSNorm, RoPE (NeoX/HF-Llama style rotate_half, fp32 frequencies), SwiGLU MLP, GQA,
    optional q/k/v biases and q/k norm, attention through
    ``torch.nn.functional.scaled_dot_product_attention`` with an explicit mask.

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
        # A plain attribute, not a buffer: ``module.to(bfloat16)`` would cast a buffer, and the
        # frequencies must stay fp32 (LLaDA's ``rope_full_precision``; HF computes them in fp32).
        self._inv_freq, self._rope_factor = rope_frequencies(
            config.head_dim, config.rope_theta, config.rope_scaling
        )
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}

    def forward(
        self,
        input_ids: torch.LongTensor,
        positions: torch.LongTensor,
        attn_mask: torch.Tensor | None = None,
        *,
        kv_cache: KVBatch | None = None,
    ) -> torch.Tensor:
        """Hidden states [B, L, D] after the final norm.

        ``positions`` [B, L] are the rotary positions of each token. ``attn_mask`` is a bool
        [B, 1, L, L] tensor over the current tokens (True = query may attend to key) or None
        for full bidirectional attention among them.

        With ``kv_cache`` (a :class:`KVBatch`, one cache per row) every query also sees its
        row's whole cached prefix, and the leading ``write[b]`` tokens' keys/values are
        appended to the row's cache. The three attention kinds are then: bidirectional
        (no cache, mask None or key padding), strictly causal (a lower-triangular mask, with or
        without a cached prefix), and block-bidirectional over a cached prefix (cache + mask
        None or key padding). Positions must continue the prefix: see ``KVBatch.positions``.
        """
        if input_ids.shape != positions.shape:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} differ"
            )
        b, length = input_ids.shape
        if attn_mask is not None and attn_mask.dtype != torch.bool:
            raise TypeError(f"attn_mask must be bool, got {attn_mask.dtype}")
        if kv_cache is not None:
            if len(kv_cache) != b:
                raise ValueError(f"kv_cache has {len(kv_cache)} rows, input_ids has {b}")
            current = (
                torch.ones(b, 1, length, length, dtype=torch.bool, device=input_ids.device)
                if attn_mask is None
                else attn_mask.expand(b, 1, length, length)
            )
            prefix = kv_cache.prefix_mask().to(input_ids.device).expand(b, 1, length, -1)
            attn_mask = torch.cat((prefix, current), dim=-1)
        if attn_mask is not None:
            # A query row with no visible key makes SDPA return NaN for it; that NaN would
            # then leak into every other row through the next layer's values (0 * NaN = NaN).
            # Such rows are padding by construction, so let them see everything instead.
            attn_mask = attn_mask | ~attn_mask.any(dim=-1, keepdim=True)
        inv_freq = self._inv_freq_on.get(positions.device)
        if inv_freq is None:  # one small copy per device, not one per forward
            inv_freq = self._inv_freq_on[positions.device] = self._inv_freq.to(positions.device)
        cos, sin = rotary_tables(positions, inv_freq, self._rope_factor)
        x = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, attn_mask, None if kv_cache is None else (kv_cache, i))
        if kv_cache is not None:
            kv_cache.commit()
        return self.norm(x)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [..., vocab_size] for hidden states [..., D]."""
        weight = self.embed_tokens.weight if self.head is None else self.head.weight
        return F.linear(hidden, weight)
