"""Nemotron-Labs-Diffusion: a Ministral3 decoder served in three views of the same weights.

The checkpoint (``model_type: nemotron_labs_diffusion``, ``NemotronLabsDiffusionModel``)
stores a Ministral3 backbone under ``encoder.`` and an untied output head ``diffusion_head``:
Llama-style SwiGLU, grouped-query attention without biases or q/k norms, YaRN RoPE over the
whole head and Llama-4 query scaling (``rope_parameters.llama_4_scaling_beta``). What makes
it a diffusion model is only how it is run: the remote code flips one flag per attention
layer between a causal view (logits at ``i`` predict token ``i + 1``, the AR view) and a
bidirectional view (logits at ``i`` predict token ``i`` itself, the diffusion view), and the
serving modes combine them (``decoding/registry.py``).

Config keys this server implements (anything else is refused with the key named):
``dlm_paradigm: "bidirectional"`` (the released inference setting; ``block_diff`` is the
training-time dual-stream layout and ``autoregressive`` a model without a diffusion view),
``hidden_act: silu``, no attention/MLP biases, no sliding window, and a positive
``block_size`` with a ``mask_token_id``. Training-only keys (``ar_loss_weight``,
``dlm_loss_weight``, ``dp_varying_mask_ratio``, ``attn_implementation``, ``use_cache``) mean
nothing to inference and are ignored, as are ``auto_map`` entries (no remote code runs).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dllm_serve.models.families.base import (
    Family,
    UnsupportedModelError,
    check_values,
    require,
    rope_error,
)
from dllm_serve.models.families.weight_names import LLAMA_LAYER, decoder_weight_map
from dllm_serve.models.rope import RopeConfigError, parse_query_scale, parse_rope
from dllm_serve.models.transformer import TransformerConfig

# Layer split keys of research variants: a non-zero value means separate AR-only or
# diffusion-only layer stacks, which the released checkpoints do not have.
_SPLIT_KEYS = ("num_ar_layers", "num_diffusion_layers")


@dataclass(frozen=True)
class NemotronFamily(Family):
    """Nemotron-Labs-Diffusion checkpoints (``encoder.*`` + ``diffusion_head``)."""

    EXPECTED = (
        ("dlm_paradigm", "bidirectional"),
        ("hidden_act", "silu"),
        ("attention_bias", False),
        ("mlp_bias", False),
    )

    def check(self, config: Mapping[str, Any]) -> None:
        check_values(self.name, config, self.EXPECTED)
        if config.get("sliding_window") is not None:
            raise UnsupportedModelError(
                f"{self.name} config has sliding_window={config['sliding_window']!r}; only "
                "full attention (sliding_window null) is supported"
            )
        for key in _SPLIT_KEYS:
            if config.get(key):
                raise UnsupportedModelError(
                    f"{self.name} config has {key}={config[key]!r}: separate AR/diffusion "
                    "layer stacks are not supported (only the fully shared stack, 0)"
                )
        if "text_config" in config or "vision_config" in config:
            raise UnsupportedModelError(
                f"{self.name}: vision-language checkpoints are not supported (text only)"
            )
        size = config.get("block_size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise UnsupportedModelError(
                f"a tri-mode config needs a positive integer block_size, got {size!r}"
            )
        require(config, "mask_token_id")

    def transformer_config(self, config: Mapping[str, Any]) -> TransformerConfig:
        self.check(config)
        d_model = int(require(config, "hidden_size"))
        n_heads = int(require(config, "num_attention_heads"))
        max_len = int(require(config, "max_position_embeddings"))
        try:
            theta, scaling = parse_rope(config, max_len, default_theta=1_000_000.0)
            query_scale = parse_query_scale(config)
        except RopeConfigError as e:
            raise rope_error(e) from None
        return TransformerConfig(
            vocab_size=int(require(config, "vocab_size")),
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
            n_layers=int(require(config, "num_hidden_layers")),
            mlp_hidden_size=int(require(config, "intermediate_size")),
            rope_theta=theta,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_sequence_length=max_len,
            head_dim=int(config.get("head_dim") or d_model // n_heads),
            rope_scaling=scaling,
            query_scale=query_scale,
        )

    def weight_map(self, tcfg: TransformerConfig) -> dict[str, str]:
        return decoder_weight_map(tcfg, LLAMA_LAYER, prefix="encoder", head="diffusion_head")

    def ignorable_tensor(self, name: str, tcfg: TransformerConfig) -> bool:
        # A tied export may still write the (identical) head.
        return super().ignorable_tensor(name, tcfg) or (
            tcfg.tie_embeddings and name == "diffusion_head.weight"
        )

    def block_size(self, config: Mapping[str, Any], block_length: int | None) -> int | None:
        """The trained block (``config.json`` ``block_size``): the diffusion mode's block and
        LinearSpec's draft length."""
        return int(config["block_size"])


NEMOTRON = NemotronFamily(
    name="nemotron",
    # The causal (AR) view: what the loader and generic code read. The diffusion view is
    # bidirectional and unshifted; decoding/registry.py chooses the view per forward.
    bidirectional=False,
    logit_shift=True,
    # Only a fallback: the loader takes config.json's mask_token_id first.
    mask_token="<SPECIAL_100>",
    eot_token=None,
    model_types=("nemotron_labs_diffusion",),
    architectures=("NemotronLabsDiffusionModel",),
    description="Nemotron-Labs-Diffusion 3B/8B/14B (tri-mode: ar, diffusion, linear_spec)",
    tri_mode=True,
)
