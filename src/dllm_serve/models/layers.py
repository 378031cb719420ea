"""The layers of the decoder: RMSNorm, the embedding, grouped-query attention, SwiGLU MLP
(the mixture-of-experts MLP is in ``moe.py``).

Attention runs in two layouts: padded rows with an explicit mask (training and the reference
tests) and the serving runtime's flat batches (``models/attention.py``: real tokens only, K/V
written to and read from the KV pool), there either one FlexAttention call for the whole batch
(``models/attention.py``) or one SDPA call per attention group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dllm_serve.models.attention import FlatBatch, flex_attend, sdpa_by_group
from dllm_serve.models.kv_pool import KVPool
from dllm_serve.models.rope import apply_rotary
from dllm_serve.models.transformer_config import TransformerConfig


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


def fused_linear(parts: list[nn.Linear]) -> nn.Linear:
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
    with one ``qkv_proj`` for serving (one matmul instead of three). Checkpoints that store the
    fused projection (``fused_qkv``, LLaDA2) load straight into ``qkv_proj``. GQA never copies
    K/V: SDPA maps query head ``h`` to kv head ``h // n_rep`` itself (``enable_gqa``), the
    HF/LLaDA ``repeat_kv`` convention.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        hd = config.head_dim
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = hd
        self.rotary_dim = config.rotary_dim
        qkv_bias = config.qkv_bias or config.o_bias
        self.q_proj: nn.Linear | None = None
        self.k_proj: nn.Linear | None = None
        self.v_proj: nn.Linear | None = None
        self.qkv_proj: nn.Linear | None = None
        if config.fused_qkv:
            out = (config.n_heads + 2 * config.n_kv_heads) * hd
            self.qkv_proj = nn.Linear(config.d_model, out, bias=qkv_bias)
        else:
            self.q_proj = nn.Linear(config.d_model, config.n_heads * hd, bias=qkv_bias)
            self.k_proj = nn.Linear(config.d_model, config.n_kv_heads * hd, bias=qkv_bias)
            self.v_proj = nn.Linear(config.d_model, config.n_kv_heads * hd, bias=qkv_bias)
        self.o_proj = nn.Linear(config.n_heads * hd, config.d_model, bias=config.o_bias)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(hd, config.rms_norm_eps) if config.qk_norm else None
        # A draft-only LoRA on o_proj (tri-mode models, ``--draft-lora``), attached after
        # loading; applied only to the tokens a forward marks as draft-view tokens.
        self.draft_lora: nn.Module | None = None

    def fuse(self) -> None:
        """Replace q/k/v projections by one fused projection (same outputs)."""
        if self.qkv_proj is None:
            assert self.q_proj is not None and self.k_proj is not None and self.v_proj is not None
            self.qkv_proj = fused_linear([self.q_proj, self.k_proj, self.v_proj])
            self.q_proj = self.k_proj = self.v_proj = None

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on the first ``rotary_dim`` dims of each head; the rest pass through (partial
        rotary, LLaDA2: rotate-half on that slice, tables built for that width)."""
        if self.rotary_dim == x.shape[-1]:
            return apply_rotary(x, cos, sin)
        r = self.rotary_dim
        return torch.cat((apply_rotary(x[..., :r], cos, sin), x[..., r:]), dim=-1)

    def project(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        q_scale: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[..., H, hd]``, k and v ``[..., Hkv, hd]`` for ``x`` ``[..., D]``, RoPE applied.

        ``cos``/``sin`` broadcast against ``[..., heads, rotary_dim]`` (``[..., 1, rotary_dim]``).
        ``q_scale`` (``[..., 1, 1]`` fp32, Llama-4 query scaling): multiplies the rotated
        queries, cast to their dtype first as transformers does; keys are not scaled.
        """
        hd, h, hkv = self.head_dim, self.n_heads, self.n_kv_heads
        lead = x.shape[:-1]
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x)
            if self.q_norm is None:
                # Rotate q and k together: one set of RoPE ops for both.
                qk = self.rotate(qkv[..., : (h + hkv) * hd].view(*lead, h + hkv, hd), cos, sin)
                v = qkv[..., (h + hkv) * hd :].view(*lead, hkv, hd)
                return _scaled(qk[..., :h, :], q_scale), qk[..., h:, :], v
            q, k, v = qkv.split([h * hd, hkv * hd, hkv * hd], dim=-1)
        else:
            assert self.q_proj is not None and self.k_proj is not None and self.v_proj is not None
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = q.view(*lead, h, hd), k.view(*lead, hkv, hd), v.view(*lead, hkv, hd)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # Qwen3, LLaDA2: per head, before RoPE
        return _scaled(self.rotate(q, cos, sin), q_scale), self.rotate(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None,
        q_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Padded rows ``x`` ``[B, L, D]`` with an explicit mask (training and references)."""
        b, length, _ = x.shape
        q, k, v = self.project(x, cos, sin, q_scale)
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
        q_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Flat tokens ``x`` ``[T, D]``: one SDPA call per attention group, no padding.

        Tokens flagged in ``batch.draft`` are computed in the draft weight view: the draft
        LoRA's update is added to their ``o_proj`` output (``models/lora.py``); every other
        token's output is the base projection, bit for bit.
        """
        q, k, v = self.project(x, cos, sin, q_scale)
        pool_k = pool_v = None
        if kv is not None and batch.slot_mapping is not None:
            pool, layer = kv
            pool_k, pool_v = pool.k[layer], pool.v[layer]
            pool_k.index_copy_(0, batch.slot_mapping, k)
            pool_v.index_copy_(0, batch.slot_mapping, v)
        if batch.flex is not None:  # every row in one call, keys read where they are
            if batch.flex.pool:
                assert pool_k is not None and pool_v is not None
                k, v = pool_k, pool_v
            attended = flex_attend(q, k, v, batch.flex).reshape(q.shape[0], -1)
            return self._output(attended, batch)
        pool_kv = None if pool_k is None or pool_v is None else (pool_k, pool_v)
        attended = sdpa_by_group(q, k, v, batch.groups, pool_kv, self.head_dim)
        return self._output(attended, batch)

    def _output(self, attended: torch.Tensor, batch: FlatBatch) -> torch.Tensor:
        """``o_proj``, and the draft LoRA's update on the draft-view tokens."""
        projected = self.o_proj(attended)
        if self.draft_lora is not None and batch.draft is not None:
            # The update is computed for every token and kept where flagged: the same
            # shapes whichever rows draft, so one captured graph serves draft and verify rows
            # together (the LoRA's rank is small: a few percent of o_proj's work).
            update = self.draft_lora(attended)
            projected = torch.where(batch.draft[:, None], projected + update, projected)
        return projected


def _scaled(q: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return q if scale is None else q * scale.to(q.dtype)


def activate(gate: torch.Tensor, activation: str) -> torch.Tensor:
    """The gate activation of a gated MLP: ``silu`` (SwiGLU) or ``gelu_tanh`` (Gemma's GeGLU,
    transformers' ``gelu_pytorch_tanh``)."""
    if activation == "silu":
        return F.silu(gate)
    return F.gelu(gate, approximate="tanh")


class MLP(nn.Module):
    """Gated MLP ``down(act(gate(x)) * up(x))``, SwiGLU by default (``activation="silu"``),
    GeGLU for Gemma; :meth:`fuse` merges gate and up."""

    def __init__(self, d_model: int, hidden_size: int, activation: str = "silu") -> None:
        super().__init__()
        self.activation = activation
        self.gate_proj: nn.Linear | None = nn.Linear(d_model, hidden_size, bias=False)
        self.up_proj: nn.Linear | None = nn.Linear(d_model, hidden_size, bias=False)
        self.gate_up_proj: nn.Linear | None = None
        self.down_proj = nn.Linear(hidden_size, d_model, bias=False)

    def fuse(self) -> None:
        if self.gate_up_proj is None:
            assert self.gate_proj is not None and self.up_proj is not None
            self.gate_up_proj = fused_linear([self.gate_proj, self.up_proj])
            self.gate_proj = self.up_proj = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            assert self.gate_proj is not None and self.up_proj is not None
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(activate(gate, self.activation) * up)
