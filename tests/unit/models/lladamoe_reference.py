"""A straightforward LLaDA-MoE forward and router, written from the checkpoint's own modeling
code (``modeling_lladamoe.py``: ``LLaDAMoEAttention``, ``LLaDAMoESparseMoeBlock``,
``LLaDAMoEDecoderLayer``), independent of ``dllm_serve.models``: plain loops, float64, explicit
softmax attention over the checkpoint's own tensor names. Slow; for tests only.

transformers' ``OlmoeForCausalLM`` is not usable as the reference: its q/k RMSNorm spans the
whole projection (``hidden_size`` wide) where LLaDA-MoE normalises each head, and its attention
is causal.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file


def reference_route(
    logits: torch.Tensor, top_k: int, renormalize: bool, scale: float = 1.0
) -> list[dict[int, float]]:
    """Per token: {expert: weight}; softmax with math.exp and a Python sort, one at a time."""
    out = []
    for row in logits.double().tolist():
        peak = max(row)
        exp = [math.exp(v - peak) for v in row]
        p = [e / sum(exp) for e in exp]
        chosen = sorted(range(len(p)), key=lambda e: -p[e])[:top_k]
        total = sum(p[e] for e in chosen) if renormalize else 1.0
        out.append({e: p[e] / total * scale for e in chosen})
    return out


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _swiglu(x: torch.Tensor, t: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    gate = x @ t[f"{prefix}.gate_proj.weight"].T
    up = x @ t[f"{prefix}.up_proj.weight"].T
    return (gate * torch.sigmoid(gate) * up) @ t[f"{prefix}.down_proj.weight"].T


def _rope(x: torch.Tensor, positions: torch.Tensor, dim: int, theta: float) -> torch.Tensor:
    """NeoX rotate-half on the first ``dim`` dims of ``x`` [L, H, hd]; the rest unchanged."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = positions.double()[:, None] * inv_freq[None]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None]
    rot, rest = x[..., :dim], x[..., dim:]
    half = dim // 2
    rotated_half = torch.cat([-rot[..., half:], rot[..., :half]], -1)
    return torch.cat([rot * cos + rotated_half * sin, rest], -1)


def load_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    return {k: v.double() for k, v in load_file(str(checkpoint / "model.safetensors")).items()}


@torch.no_grad()
def reference_logits(
    tensors: dict[str, torch.Tensor],
    config: dict[str, Any],
    tokens: list[int],
    *,
    qk_norm_per_head: bool = True,
    renormalize: bool = False,
) -> torch.Tensor:
    """Logits [L, vocab] (float64) of ``tokens`` at positions 0..L-1, full bidirectional
    attention. ``qk_norm_per_head=False`` (transformers' OLMoE) and ``renormalize=True`` are
    the variants LLaDA-MoE is *not*, for tests that must tell them apart."""
    t = tensors
    eps, theta = config["rms_norm_eps"], float(config["rope_theta"])
    h = config["num_attention_heads"]
    hkv = config.get("num_key_value_heads") or h
    hd = config["hidden_size"] // h
    rotary = int(hd * config["partial_rotary_factor"])
    n = len(tokens)
    pos = torch.arange(n)
    x = t["model.embed_tokens.weight"][torch.tensor(tokens)]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        a = _rms(x, t[f"{p}.input_layernorm.weight"], eps)
        q = a @ t[f"{p}.self_attn.q_proj.weight"].T
        k = a @ t[f"{p}.self_attn.k_proj.weight"].T
        v = (a @ t[f"{p}.self_attn.v_proj.weight"].T).view(n, hkv, hd)
        if config.get("qk_layernorm"):
            qw, kw = t[f"{p}.self_attn.q_norm.weight"], t[f"{p}.self_attn.k_norm.weight"]
            if qk_norm_per_head:
                q, k = _rms(q.view(n, h, hd), qw, eps), _rms(k.view(n, hkv, hd), kw, eps)
            else:  # over the whole projection, with the per-head weight tiled
                q, k = _rms(q, qw.repeat(h), eps), _rms(k, kw.repeat(hkv), eps)
        q, k = (
            _rope(q.view(n, h, hd), pos, rotary, theta),
            _rope(k.view(n, hkv, hd), pos, rotary, theta),
        )
        heads = []
        for head in range(h):
            kv = head // (h // hkv)
            scores = q[:, head] @ k[:, kv].T / math.sqrt(hd)
            heads.append(torch.softmax(scores, -1) @ v[:, kv])
        x = x + torch.cat(heads, -1) @ t[f"{p}.self_attn.o_proj.weight"].T
        m = _rms(x, t[f"{p}.post_attention_layernorm.weight"], eps)
        if config["moe_layer_freq"][i] == 0:
            x = x + _swiglu(m, t, f"{p}.mlp")
            continue
        routes = reference_route(
            m @ t[f"{p}.mlp.gate.weight"].T, config["num_experts_per_tok"], renormalize
        )
        routed = torch.stack([
            sum(w * _swiglu(m[j], t, f"{p}.mlp.experts.{e}") for e, w in route.items())
            for j, route in enumerate(routes)
        ])  # fmt: skip
        if config.get("shared_expert_intermediate_size"):
            routed = routed + _swiglu(m, t, f"{p}.shared_expert")
        x = x + routed
    head = t["model.embed_tokens.weight" if config["tie_word_embeddings"] else "lm_head.weight"]
    return _rms(x, t["model.norm.weight"], eps) @ head.T
