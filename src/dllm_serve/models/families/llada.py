"""LLaDA-8B (Base/Instruct) and LLaDA-1.5: OLMo-style config.json, Llama-style blocks.

Bidirectional attention, no logit shift, positions ``0..L-1`` including left padding, mask
``<|mdm_mask|>`` (126336 in the real checkpoints), end of turn ``<|eot_id|>``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dllm_serve.models.families.base import Family, UnsupportedModelError, require, rope_error
from dllm_serve.models.rope import RopeConfigError, parse_rope
from dllm_serve.models.transformer import TransformerConfig


@dataclass(frozen=True)
class LLaDAFamily(Family):
    """LLaDA-8B (Base/Instruct) and LLaDA-1.5: OLMo-style config, Llama-style blocks."""

    # Keys that must be present with exactly this value. LLaDA's own code fills an absent key
    # from LLaDAConfig's GPT-2-like defaults (sequential blocks, no RoPE, LayerNorm), which is
    # a network this module does not build, so absence is as unsupported as another value.
    REQUIRED = (
        ("block_type", "llama"),
        ("rope", True),
        ("alibi", False),
        ("layer_norm_type", "rms"),
    )
    # Other keys that would change the network; the real configs carry them all, but they are
    # checked only when present so that trimmed hand-written configs still load.
    OPTIONAL = (
        ("activation_type", "silu"),
        ("include_bias", False),
        ("include_qkv_bias", False),
        ("bias_for_layer_norm", False),
        ("layer_norm_with_affine", True),
        ("attention_layer_norm", False),
        ("block_group_size", 1),
        ("input_emb_norm", False),
        ("scale_logits", False),
    )

    def check(self, config: Mapping[str, Any]) -> None:
        for key, want in self.REQUIRED:
            if key not in config:
                raise UnsupportedModelError(
                    f"LLaDA config.json lacks {key!r}; only {key}={want!r} is supported"
                )
        for key, want in (*self.REQUIRED, *self.OPTIONAL):
            if key in config and config[key] != want:
                raise UnsupportedModelError(
                    f"LLaDA config has {key}={config[key]!r}; only {key}={want!r} is supported"
                )

    def transformer_config(self, config: Mapping[str, Any]) -> TransformerConfig:
        self.check(config)
        d_model = int(require(config, "d_model"))
        n_heads = int(require(config, "n_heads"))
        # LLaDA's rules: multi_query_attention wins, then n_kv_heads, else MHA.
        if config.get("multi_query_attention"):
            n_kv_heads = 1
        else:
            n_kv_heads = int(config.get("n_kv_heads") or n_heads)
        mlp = config.get("mlp_hidden_size") or int(config.get("mlp_ratio", 4)) * d_model
        # The matrices have embedding_size rows (vocab_size padded up); ids live below vocab_size.
        vocab = config.get("embedding_size") or require(config, "vocab_size")
        max_len = int(require(config, "max_sequence_length"))
        try:  # top-level rope_theta (as published) or a 5.x-style rope_parameters dict
            theta, scaling = parse_rope(config, max_len)
        except RopeConfigError as e:
            raise rope_error(e) from None
        if scaling is not None:
            raise UnsupportedModelError(
                f"LLaDA config asks for RoPE scaling {scaling.rope_type!r}; LLaDA's own code "
                "applies none, so it is not supported"
            )
        return TransformerConfig(
            vocab_size=int(vocab),
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            n_layers=int(require(config, "n_layers")),
            mlp_hidden_size=int(mlp),
            rope_theta=theta,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            # LLaDAConfig defaults weight_tying to True, so only an explicit false unties.
            tie_embeddings=bool(config.get("weight_tying", True)),
            max_sequence_length=max_len,
        )

    def weight_map(self, tcfg: TransformerConfig) -> dict[str, str]:
        names = {"model.transformer.wte.weight": "embed_tokens.weight"}
        per_block = {
            "attn_norm": "attn_norm",
            "q_proj": "attn.q_proj",
            "k_proj": "attn.k_proj",
            "v_proj": "attn.v_proj",
            "attn_out": "attn.o_proj",
            "ff_norm": "mlp_norm",
            "ff_proj": "mlp.gate_proj",  # SiLU is applied to ff_proj's output
            "up_proj": "mlp.up_proj",
            "ff_out": "mlp.down_proj",
        }
        for i in range(tcfg.n_layers):
            for theirs, ours in per_block.items():
                names[f"model.transformer.blocks.{i}.{theirs}.weight"] = f"layers.{i}.{ours}.weight"
        names["model.transformer.ln_f.weight"] = "norm.weight"
        if not tcfg.tie_embeddings:
            names["model.transformer.ff_out.weight"] = "head.weight"
        return names


LLADA = LLaDAFamily(
    name="llada",
    bidirectional=True,
    logit_shift=False,
    mask_token="<|mdm_mask|>",
    eot_token="<|eot_id|>",
    model_types=("llada",),
    architectures=("LLaDAModelLM",),
    description="LLaDA-8B-Base/Instruct, LLaDA-1.5",
)
