"""transformers' own Ministral3 modules as the reference for a Nemotron-format checkpoint
(test helper). Built from the checkpoint's config.json and safetensors directly, never from
``dllm_serve.models``: ``encoder.*`` → ``model.*``, ``diffusion_head`` → ``lm_head``."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file

MINISTRAL3_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
    "tie_word_embeddings", "rope_parameters", "sliding_window", "hidden_act",
)  # fmt: skip


def ministral3_reference(path: Path) -> torch.nn.Module:
    """``Ministral3ForCausalLM`` (fp32, eager attention) holding the checkpoint's weights."""
    config = json.loads((path / "config.json").read_text())
    cfg = transformers.Ministral3Config(**{k: config[k] for k in MINISTRAL3_KEYS})
    # eager: an implementation independent of the SDPA kernel we call ourselves.
    cfg._attn_implementation = "eager"
    model = transformers.Ministral3ForCausalLM(cfg).eval()
    state = {}
    for file in sorted(path.glob("model*.safetensors")):
        for name, tensor in load_file(file).items():
            name = "lm_head.weight" if name == "diffusion_head.weight" else name
            state[name.replace("encoder.", "model.", 1)] = tensor.float()
    model.load_state_dict(state, strict=True)
    return model


def additive(allowed: torch.Tensor) -> torch.Tensor:
    """A bool ``[L, S]`` (True = may attend) as transformers' 4-D additive mask ``[1, 1, L, S]``."""
    zeros = torch.zeros(allowed.shape, dtype=torch.float32)
    return zeros.masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]


def reference_logits(
    model: torch.nn.Module, ids: list[int], positions: list[int], allowed: torch.Tensor
) -> torch.Tensor:
    """Logits ``[L, V]`` of one row under an explicit attention pattern."""
    out = model(
        input_ids=torch.tensor([ids]),
        position_ids=torch.tensor([positions]),
        attention_mask=additive(allowed),
    )
    return out.logits[0]
