"""transformers' own Qwen2/Qwen3 modules as the reference for our decoder (test helper).

The reference is built from the checkpoint's config.json and safetensors directly, not from
anything in ``dllm_serve.models``, so a wrong mapping there cannot hide in both.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file

QWEN_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
    "head_dim", "attention_bias",
)  # fmt: skip


def hf_reference(path: Path, rope_parameters: dict | None = None) -> torch.nn.Module:
    """``Qwen2ForCausalLM`` (Dream, Fast-dLLM v2) or ``Qwen3ForCausalLM`` (SDAR / qwen3) for a
    checkpoint, fp32, eager attention, weights loaded strictly under the checkpoint's own names."""
    config = json.loads((path / "config.json").read_text())
    kwargs = {k: config[k] for k in QWEN_KEYS if k in config}
    kwargs["rope_parameters"] = rope_parameters or {
        "rope_type": "default",
        "rope_theta": config["rope_theta"],
    }
    if config["model_type"] in ("Dream", "Fast_dLLM_Qwen"):
        cls, cfg = transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**kwargs)
    else:
        cls, cfg = transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**kwargs)
    # eager: an implementation independent of the SDPA kernel we call ourselves.
    cfg._attn_implementation = "eager"
    model = cls(cfg).eval()
    state = {}
    for file in sorted(path.glob("model*.safetensors")):
        state.update({k: v.float() for k, v in load_file(file).items()})
    model.load_state_dict(state, strict=True)
    return model


def float_mask(bool_mask: torch.Tensor) -> torch.Tensor:
    """transformers' 4-D additive mask: 0 where allowed, finfo.min where not."""
    zeros = torch.zeros(bool_mask.shape, dtype=torch.float32)
    return zeros.masked_fill(~bool_mask, torch.finfo(torch.float32).min)


def padded_mask(lengths: list[int], width: int, *, causal: bool, left: bool) -> torch.Tensor:
    """[B,1,L,L] bool: key padding (left or right), plus lower-triangular when causal."""
    cols = torch.arange(width)
    n = torch.tensor(lengths)[:, None]
    valid = cols[None] >= width - n if left else cols[None] < n  # [B, L]
    mask = valid[:, None, None, :].expand(len(lengths), 1, width, width).clone()
    if causal:
        mask &= torch.ones(width, width, dtype=torch.bool).tril()
    return mask


def perturb_norms(path: Path, seed: int = 0) -> None:
    """Give every norm weight of a tiny checkpoint non-trivial values (ones would hide a
    swapped or skipped norm), in place."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    for file in sorted(path.glob("model*.safetensors")):
        tensors = load_file(file)
        for name, t in tensors.items():
            if name.endswith("norm.weight"):
                tensors[name] = (0.5 + torch.rand(t.shape, generator=g)).to(t.dtype)
        save_file(tensors, str(file), metadata={"format": "pt"})
