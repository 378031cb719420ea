"""Per-family rules: which config keys mean what, which tensor names map where, and the
diffusion conventions (attention kind, logit shift, mask/EOT token strings).

A family never hard-codes token ids: it names token *strings*, and the loader reads the ids
from the checkpoint's config and tokenizer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dllm_serve.models.transformer import TransformerConfig


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is not one this server implements."""


@dataclass(frozen=True)
class Family:
    """Rules shared by every checkpoint of one model family.

    Subclasses implement :meth:`check`, :meth:`transformer_config` and :meth:`weight_map`.
    """

    name: str
    bidirectional: bool
    logit_shift: bool
    mask_token: str
    eot_token: str | None

    def check(self, config: Mapping[str, Any]) -> None:
        """Raise :class:`UnsupportedModelError` unless this server implements ``config``."""
        raise NotImplementedError

    def transformer_config(self, config: Mapping[str, Any]) -> TransformerConfig:
        """The :class:`TransformerConfig` described by a checkpoint's ``config.json``."""
        raise NotImplementedError

    def weight_map(self, tcfg: TransformerConfig) -> dict[str, str]:
        """Every tensor name the checkpoint must contain -> its name in ``DecoderTransformer``."""
        raise NotImplementedError


def _require(config: Mapping[str, Any], key: str) -> Any:
    if config.get(key) is None:
        raise UnsupportedModelError(f"config.json lacks required key {key!r}")
    return config[key]


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
        d_model = int(_require(config, "d_model"))
        n_heads = int(_require(config, "n_heads"))
        # LLaDA's rules: multi_query_attention wins, then n_kv_heads, else MHA.
        if config.get("multi_query_attention"):
            n_kv_heads = 1
        else:
            n_kv_heads = int(config.get("n_kv_heads") or n_heads)
        mlp = config.get("mlp_hidden_size") or int(config.get("mlp_ratio", 4)) * d_model
        # The matrices have embedding_size rows (vocab_size padded up); ids live below vocab_size.
        vocab = config.get("embedding_size") or _require(config, "vocab_size")
        return TransformerConfig(
            vocab_size=int(vocab),
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            n_layers=int(_require(config, "n_layers")),
            mlp_hidden_size=int(mlp),
            rope_theta=float(config.get("rope_theta", 10000.0)),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            # LLaDAConfig defaults weight_tying to True, so only an explicit false unties.
            tie_embeddings=bool(config.get("weight_tying", True)),
            max_sequence_length=int(_require(config, "max_sequence_length")),
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
)

FAMILIES: dict[str, Family] = {LLADA.name: LLADA}

# Keys that only mixture-of-experts configs carry.
_MOE_KEYS = (
    "num_experts",
    "moe_num_experts",
    "num_experts_per_tok",
    "moe_topk",
    "n_routed_experts",
)


def _is_moe(config: Mapping[str, Any]) -> bool:
    archs = config.get("architectures") or []
    model_type = str(config.get("model_type", "")).lower()
    return (
        any("moe" in str(a).lower() for a in archs)
        or "moe" in model_type
        or any(config.get(k) for k in _MOE_KEYS)
    )


def family_for(config: Mapping[str, Any]) -> Family:
    """The :class:`Family` for a checkpoint's ``config.json`` contents, chosen by ``model_type``."""
    supported = ", ".join(sorted(FAMILIES))
    model_type = config.get("model_type")
    # LLaDA-MoE ships with model_type "llada" too, so this check must come before the lookup.
    if _is_moe(config):
        raise UnsupportedModelError(
            f"mixture-of-experts checkpoints (model_type={model_type!r}, "
            f"architectures={config.get('architectures')!r}) are not supported; "
            f"supported dense model types: {supported}"
        )
    family = FAMILIES.get(str(model_type).lower()) if model_type is not None else None
    if family is None:
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r}; supported model types: {supported}"
        )
    family.check(config)
    return family
