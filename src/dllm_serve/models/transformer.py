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

from dllm_serve.models.flat_batch import FlatBatch
from dllm_serve.models.kv_pool import KVPool
from dllm_serve.models.rope import RopeScaling, apply_rotary, rope_frequencies, rotary_table


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
    """Root-mean-square norm: normalise in fp32, cast back, then scale (LLaDA, HF Llama/Qwen).

    One fused ``F.rms_norm`` call, which upcasts half-precision inputs to fp32 for the
    statistics and casts the normalised value back before the weight, as the references do.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Embedding(nn.Embedding):
    """``nn.Embedding`` that skips random init on the meta device.

    The loader builds the network on ``meta`` and assigns checkpoint tensors; ``normal_`` has no
    meta kernel and its Python fallback costs a one-off ~2 s import of ``torch._dynamo``.
    """

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


def _fused_linear(parts: list[nn.Linear]) -> nn.Linear:
    """One ``nn.Linear`` whose output is the concatenation of ``parts``' outputs."""
    weight = torch.cat([p.weight for p in parts])
    # Built on meta: a random init of the fused shape would be computed and thrown away.
    with torch.device("meta"):
        fused = nn.Linear(weight.shape[1], weight.shape[0], bias=parts[0].bias is not None)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if parts[0].bias is not None:
        fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
    return fused


class Attention(nn.Module):
    """Grouped-query attention; optional q/k/v (and o) biases and per-head q/k RMSNorm.

    Checkpoints load into separate ``q_proj``/``k_proj``/``v_proj``; :meth:`fuse` replaces them
    with one ``qkv_proj`` for serving (one matmul instead of three). GQA never copies K/V: SDPA
    maps query head ``h`` to kv head ``h // n_rep`` itself (``enable_gqa``), the HF/LLaDA
    ``repeat_kv`` convention.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        hd = config.head_dim
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = hd
        qkv_bias = config.qkv_bias or config.o_bias
        self.q_proj: nn.Linear | None = nn.Linear(
            config.d_model, config.n_heads * hd, bias=qkv_bias
        )
        self.k_proj: nn.Linear | None = nn.Linear(
            config.d_model, config.n_kv_heads * hd, bias=qkv_bias
        )
        self.v_proj: nn.Linear | None = nn.Linear(
            config.d_model, config.n_kv_heads * hd, bias=qkv_bias
        )
        self.qkv_proj: nn.Linear | None = None
        self.o_proj = nn.Linear(config.n_heads * hd, config.d_model, bias=config.o_bias)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(hd, config.rms_norm_eps) if config.qk_norm else None

    def fuse(self) -> None:
        """Replace q/k/v projections by one fused projection (same outputs)."""
        if self.qkv_proj is None:
            assert self.q_proj is not None and self.k_proj is not None and self.v_proj is not None
            self.qkv_proj = _fused_linear([self.q_proj, self.k_proj, self.v_proj])
            self.q_proj = self.k_proj = self.v_proj = None

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[..., H, hd]``, k and v ``[..., Hkv, hd]`` for ``x`` ``[..., D]``, RoPE applied.

        ``cos``/``sin`` broadcast against ``[..., heads, hd]`` (``[..., 1, hd]``).
        """
        hd, h, hkv = self.head_dim, self.n_heads, self.n_kv_heads
        lead = x.shape[:-1]
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x)
            if self.q_norm is None:
                # Rotate q and k together: one set of RoPE ops for both.
                qk = apply_rotary(qkv[..., : (h + hkv) * hd].view(*lead, h + hkv, hd), cos, sin)
                v = qkv[..., (h + hkv) * hd :].view(*lead, hkv, hd)
                return qk[..., :h, :], qk[..., h:, :], v
            q, k, v = qkv.split([h * hd, hkv * hd, hkv * hd], dim=-1)
        else:
            assert self.q_proj is not None and self.k_proj is not None and self.v_proj is not None
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = q.view(*lead, h, hd), k.view(*lead, hkv, hd), v.view(*lead, hkv, hd)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # Qwen3: per head, before RoPE
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Padded rows ``x`` ``[B, L, D]`` with an explicit mask (training and references)."""
        b, length, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=attn_mask, enable_gqa=self.n_kv_heads != self.n_heads,
        )  # fmt: skip
        return self.o_proj(out.transpose(1, 2).reshape(b, length, -1))

    def forward_flat(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: FlatBatch,
        kv: tuple[KVPool, int] | None,
    ) -> torch.Tensor:
        """Flat tokens ``x`` ``[T, D]``: one SDPA call per attention group, no padding."""
        q, k, v = self.project(x, cos, sin)
        pool_k = pool_v = None
        if kv is not None and batch.slot_mapping is not None:
            pool, layer = kv
            pool_k, pool_v = pool.k[layer], pool.v[layer]
            pool_k.index_copy_(0, batch.slot_mapping, k)
            pool_v.index_copy_(0, batch.slot_mapping, v)
        gqa = self.n_kv_heads != self.n_heads
        outs = []
        for g in batch.groups:
            shape = (g.rows, g.q_len, -1, self.head_dim)
            qg = q[g.start : g.end].view(shape).transpose(1, 2)
            if g.kv_slots is None:
                kg = k[g.start : g.end].view(shape).transpose(1, 2)
                vg = v[g.start : g.end].view(shape).transpose(1, 2)
            else:
                assert pool_k is not None and pool_v is not None
                kg, vg = pool_k[g.kv_slots].transpose(1, 2), pool_v[g.kv_slots].transpose(1, 2)
            out = F.scaled_dot_product_attention(
                qg, kg, vg, attn_mask=g.mask, is_causal=g.is_causal, enable_gqa=gqa
            )
            outs.append(out.transpose(1, 2).reshape(g.end - g.start, -1))
        return self.o_proj(outs[0] if len(outs) == 1 else torch.cat(outs))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``; :meth:`fuse` merges gate and up."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.gate_proj: nn.Linear | None = nn.Linear(
            config.d_model, config.mlp_hidden_size, bias=False
        )
        self.up_proj: nn.Linear | None = nn.Linear(
            config.d_model, config.mlp_hidden_size, bias=False
        )
        self.gate_up_proj: nn.Linear | None = None
        self.down_proj = nn.Linear(config.mlp_hidden_size, config.d_model, bias=False)

    def fuse(self) -> None:
        if self.gate_up_proj is None:
            assert self.gate_proj is not None and self.up_proj is not None
            self.gate_up_proj = _fused_linear([self.gate_proj, self.up_proj])
            self.gate_proj = self.up_proj = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            assert self.gate_proj is not None and self.up_proj is not None
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


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

    def forward_flat(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: FlatBatch,
        kv: tuple[KVPool, int] | None,
    ) -> torch.Tensor:
        x = x + self.attn.forward_flat(self.attn_norm(x), cos, sin, batch, kv)
        return x + self.mlp(self.mlp_norm(x))


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
        self._rope_tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def fuse_projections(self) -> DecoderTransformer:
        """Fuse q/k/v and gate/up projections (for serving; same outputs, fewer kernels)."""
        for layer in self.layers:
            layer.attn.fuse()
            layer.mlp.fuse()
        return self

    def rope(
        self, positions: torch.Tensor, max_position: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[*positions.shape, 1, head_dim]`` (fp32) looked up in a cached table.

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
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, attn_mask)
        return self.norm(x)

    def forward_flat(self, batch: FlatBatch, pool: KVPool | None = None) -> torch.Tensor:
        """Final-normed hidden states ``[N, D]`` at ``batch.logits_index`` only.

        K/V of every token are written to ``pool`` at ``batch.slot_mapping`` (when given)
        before attention reads them, so a group's keys may be gathered from the pool.
        """
        cos, sin = self.rope(batch.positions, batch.max_position)
        x = self.embed_tokens(batch.input_ids)
        for i, layer in enumerate(self.layers):
            x = layer.forward_flat(x, cos, sin, batch, None if pool is None else (pool, i))
        # The norm is per token: select first, normalise only what the LM head will read.
        return self.norm(x.index_select(0, batch.logits_index))

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [..., vocab_size] for hidden states [..., D]."""
        weight = self.embed_tokens.weight if self.head is None else self.head.weight
        return F.linear(hidden, weight)
