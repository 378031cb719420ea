"""A straightforward LLaDA2 forward and router written from the spec (reference
``block_diffusion.md`` §2.2), independent of ``dllm_serve.models``: plain loops and explicit
softmax attention over the checkpoint's own tensor names. Slow; for tests only.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file


def reference_route(
    logits: torch.Tensor, bias: torch.Tensor, cfg: dict[str, Any]
) -> list[dict[int, float]]:
    """Per token: {expert: weight}, one token at a time with Python sorting."""
    n_experts, n_group = cfg["num_experts"], cfg["n_group"]
    size = n_experts // n_group
    out = []
    for row in logits.double():
        s = [1 / (1 + math.exp(-float(v))) for v in row]
        b = [s[e] + float(bias[e]) for e in range(n_experts)]
        group_score = [
            sum(sorted(b[g * size : (g + 1) * size], reverse=True)[:2]) for g in range(n_group)
        ]
        groups = sorted(range(n_group), key=lambda g: -group_score[g])[: cfg["topk_group"]]
        candidates = [e for g in groups for e in range(g * size, (g + 1) * size)]
        chosen = sorted(candidates, key=lambda e: -b[e])[: cfg["num_experts_per_tok"]]
        total = sum(s[e] for e in chosen) + 1e-20
        out.append({e: s[e] / total * cfg["routed_scaling_factor"] for e in chosen})
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
    angles = positions.double()[:, None] * inv_freq[None]  # [L, dim/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None]
    rot, rest = x[..., :dim], x[..., dim:]
    half = dim // 2
    rotated_half = torch.cat([-rot[..., half:], rot[..., :half]], -1)
    return torch.cat([rot * cos + rotated_half * sin, rest], -1)


@torch.no_grad()
def reference_logits(checkpoint: Path, config: dict[str, Any], tokens: list[int], block: int):
    """Logits [L, vocab] (float64) of ``tokens`` at positions 0..L-1 under the block-causal
    mask (query i sees key j iff j // block <= i // block)."""
    t = {k: v.double() for k, v in load_file(str(checkpoint / "model.safetensors")).items()}
    eps, theta = config["rms_norm_eps"], float(config["rope_theta"])
    h, hkv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    rotary = int(hd * config["partial_rotary_factor"])
    n = len(tokens)
    pos = torch.arange(n)
    allowed = (pos[None, :] // block) <= (pos[:, None] // block)
    x = t["model.word_embeddings.weight"][torch.tensor(tokens)]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        a = _rms(x, t[f"{p}.input_layernorm.weight"], eps)
        qkv = a @ t[f"{p}.attention.query_key_value.weight"].T
        q = qkv[:, : h * hd].view(n, h, hd)
        k = qkv[:, h * hd : (h + hkv) * hd].view(n, hkv, hd)
        v = qkv[:, (h + hkv) * hd :].view(n, hkv, hd)
        q = _rms(q, t[f"{p}.attention.query_layernorm.weight"], eps)
        k = _rms(k, t[f"{p}.attention.key_layernorm.weight"], eps)
        q, k = _rope(q, pos, rotary, theta), _rope(k, pos, rotary, theta)
        heads = []
        for head in range(h):
            kv = head // (h // hkv)
            scores = q[:, head] @ k[:, kv].T / math.sqrt(hd)
            scores = scores.masked_fill(~allowed, float("-inf"))
            heads.append(torch.softmax(scores, -1) @ v[:, kv])
        x = x + torch.cat(heads, -1) @ t[f"{p}.attention.dense.weight"].T
        m = _rms(x, t[f"{p}.post_attention_layernorm.weight"], eps)
        if i < config["first_k_dense_replace"]:
            x = x + _swiglu(m, t, f"{p}.mlp")
            continue
        routes = reference_route(
            m @ t[f"{p}.mlp.gate.weight"].T, t[f"{p}.mlp.gate.expert_bias"], config
        )
        routed = torch.stack([
            sum(w * _swiglu(m[j], t, f"{p}.mlp.experts.{e}") for e, w in route.items())
            for j, route in enumerate(routes)
        ])  # fmt: skip
        x = x + routed + _swiglu(m, t, f"{p}.mlp.shared_experts")
    return _rms(x, t["model.norm.weight"], eps) @ t["lm_head.weight"].T
