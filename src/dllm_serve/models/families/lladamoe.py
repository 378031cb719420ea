"""LLaDA-MoE-7B-A1B (Base/Instruct; ``LLaDAMoEModelLM``): LLaDA's full-canvas masked diffusion
on an OLMoE-style mixture of experts.

Decoding is LLaDA-8B's (bidirectional attention over the whole canvas, no logit shift); the
checkpoint format and the network are not. Its config.json says ``model_type: "llada"`` like
LLaDA-8B's, so this family is recognised by its mixture-of-experts keys (``num_experts``,
``expert_intermediate_size``) or its architecture, never by the model type alone. The network,
as the checkpoint's own ``modeling_lladamoe.py`` builds it:

- ``self_attn.{q,k,v,o}_proj`` without biases, ``head_dim = hidden_size / num_attention_heads``;
  with ``qk_layernorm``, RMSNorm ``q_norm``/``k_norm`` over each head's ``head_dim`` (not over
  the whole projection, as transformers' OLMoE does) before RoPE; RoPE (rotate-half) on the
  first ``partial_rotary_factor × head_dim`` dims of each head;
- layer ``i`` is MoE when ``moe_layer_freq[i]`` is 1: router ``mlp.gate`` (softmax over the
  experts, top ``num_experts_per_tok``, the chosen probabilities used as they are — the
  modeling code hard-codes ``norm_topk_prob = False``), SwiGLU experts ``mlp.experts.{e}.*``
  ``expert_intermediate_size`` wide, plus ``shared_expert.*`` on the same input when
  ``shared_expert_intermediate_size`` is set; else a dense SwiGLU ``dense_intermediate_size``
  wide;
- untied ``lm_head`` unless ``tie_word_embeddings``.

Tokens (the Ling tokenizer LLaDA2 also uses): mask ``<|mask|>`` (156895 in the real checkpoints,
which config.json does not state), end of text ``<|endoftext|>`` (156892), end of turn
``<|role_end|>``; all read from the checkpoint's files.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dllm_serve.models.families.base import (
    Family,
    UnsupportedModelError,
    check_values,
    positive_int,
    rope_error,
)
from dllm_serve.models.families.weight_names import LLAMA_LAYER, decoder_weight_map, moe_mlp_names
from dllm_serve.models.rope import RopeConfigError, parse_rope, partial_rotary_factor
from dllm_serve.models.transformer import TransformerConfig
from dllm_serve.models.transformer_config import MoEConfig

LABEL = "LLaDA-MoE"
# Keys only the mixture-of-experts format carries; with model_type "llada" they decide.
MOE_KEYS = ("num_experts", "num_experts_per_tok", "expert_intermediate_size")
# Checked when present and not null: every other value describes a network the checkpoint's
# modeling code builds differently (or not at all), so it is refused, naming the key.
EXPECTED = (
    ("hidden_act", "silu"),
    ("attention_bias", False),
    ("moe_router_score_function", "softmax"),  # the modeling code always uses softmax
    # The modeling code adds this bias to the softmax probabilities, dInfer's fused path
    # ignores it; no released checkpoint enables it, so there is no reference to match.
    ("moe_router_enable_expert_bias", False),
    # The modeling code never renormalises (it hard-codes norm_topk_prob = False), so true
    # here would contradict the network the weights were trained in.
    ("norm_topk_prob", False),
    ("routed_scaling_factor", 1),  # ignored by the modeling code: only 1 means the same
)
# The checkpoint's config class defaults these to -1 or [], values its code cannot run with.
REQUIRED = (
    "hidden_size",
    "num_attention_heads",
    "num_hidden_layers",
    "vocab_size",
    "num_experts",
    "num_experts_per_tok",
    "expert_intermediate_size",
    "moe_layer_freq",
)
# Likewise required, at the top level or (transformers 5.x) inside rope_parameters.
ROPE_REQUIRED = ("rope_theta", "partial_rotary_factor")


def _int(config: Mapping[str, Any], key: str) -> int:
    return positive_int(LABEL, config, key)


def _moe_layers(config: Mapping[str, Any], n_layers: int) -> tuple[bool, ...]:
    freq = config["moe_layer_freq"]
    if (
        not isinstance(freq, list)
        or len(freq) != n_layers
        or any(f not in (0, 1) or isinstance(f, float) for f in freq)
    ):
        raise UnsupportedModelError(
            f"{LABEL} config.json: moe_layer_freq must list 0 (dense) or 1 (MoE) for each of "
            f"the {n_layers} layers, got {freq!r}"
        )
    return tuple(bool(f) for f in freq)


@dataclass(frozen=True)
class LLaDAMoEFamily(Family):
    """LLaDA-MoE checkpoints (see the module docstring)."""

    def matches(self, config: Mapping[str, Any]) -> bool:
        model_type = str(config.get("model_type") or "").lower()
        by_arch = any(a in self.architectures for a in config.get("architectures") or [])
        if model_type == "lladamoe":  # the name third-party loaders rename it to
            return True
        if model_type:
            return model_type in self.model_types and (
                by_arch or any(config.get(k) for k in MOE_KEYS)
            )
        return by_arch

    def check(self, config: Mapping[str, Any]) -> None:
        check_values(self.name, config, EXPECTED)
        for key in REQUIRED:
            if config.get(key) is None:
                raise UnsupportedModelError(f"{LABEL} config.json lacks required key {key!r}")
        if config.get("clip_qkv") is not None:
            raise UnsupportedModelError(
                f"{LABEL} config has clip_qkv={config['clip_qkv']!r}; only null is supported"
            )
        for key in ("router_num_group", "router_topk_group"):  # unused by the modeling code
            value = config.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool) and value > 1:
                raise UnsupportedModelError(
                    f"{LABEL} config has {key}={value!r}; group-limited routing is not part "
                    "of LLaDA-MoE (only null or a value <= 1 is supported)"
                )
        params = config.get("rope_parameters")
        params = params if isinstance(params, Mapping) else {}
        for key in ROPE_REQUIRED:
            if config.get(key) is None and params.get(key) is None:
                raise UnsupportedModelError(f"{LABEL} config.json lacks required key {key!r}")

    def transformer_config(self, config: Mapping[str, Any]) -> TransformerConfig:
        self.check(config)
        d_model, n_heads = _int(config, "hidden_size"), _int(config, "num_attention_heads")
        n_layers = _int(config, "num_hidden_layers")
        if d_model % n_heads:
            raise UnsupportedModelError(
                f"{LABEL} config.json: hidden_size {d_model} is not divisible by "
                f"num_attention_heads {n_heads}"
            )
        head_dim = d_model // n_heads  # the modeling code ignores any head_dim key
        if config.get("head_dim") not in (None, head_dim):
            raise UnsupportedModelError(
                f"{LABEL} config.json: head_dim {config['head_dim']!r} differs from "
                f"hidden_size / num_attention_heads ({head_dim})"
            )
        max_len = int(config.get("max_position_embeddings") or 4096)
        try:
            theta, scaling = parse_rope(config, max_len, allow_partial=True)
            rotary_dim = int(head_dim * partial_rotary_factor(config))
        except RopeConfigError as e:
            raise rope_error(e) from None
        moe_layers = _moe_layers(config, n_layers)
        # Only layers with moe_layer_freq 0 are dense; with none, no module reads the width.
        dense = 0 if all(moe_layers) else _int(config, "dense_intermediate_size")
        shared = config.get("shared_expert_intermediate_size")
        shared_width = 0 if shared is None else _int(config, "shared_expert_intermediate_size")
        try:
            moe = MoEConfig(
                routing="softmax",
                num_experts=_int(config, "num_experts"),
                top_k=_int(config, "num_experts_per_tok"),
                expert_hidden_size=_int(config, "expert_intermediate_size"),
                shared_hidden_size=shared_width,
                renormalize=False,
                moe_layers=moe_layers,
            )
            return TransformerConfig(
                vocab_size=_int(config, "vocab_size"),
                d_model=d_model,
                n_heads=n_heads,
                n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
                n_layers=n_layers,
                mlp_hidden_size=dense,
                rope_theta=theta,
                rms_norm_eps=float(config.get("rms_norm_eps") or 1e-5),
                tie_embeddings=bool(config.get("tie_word_embeddings", False)),
                max_sequence_length=max_len,
                head_dim=head_dim,
                qk_norm=bool(config.get("qk_layernorm")),
                rope_scaling=scaling,
                rotary_dim=rotary_dim,
                moe=moe,
            )
        except UnsupportedModelError:
            raise  # names the key already
        except ValueError as e:  # inconsistent sizes: say so as an unsupported config
            raise UnsupportedModelError(f"{LABEL} config.json: {e}") from None

    def weight_map(self, tcfg: TransformerConfig) -> dict[str, str]:
        moe = tcfg.moe
        assert moe is not None
        attention = {k: v for k, v in LLAMA_LAYER.items() if not k.startswith("mlp.")}
        if tcfg.qk_norm:
            attention["self_attn.q_norm.weight"] = "attn.q_norm.weight"
            attention["self_attn.k_norm.weight"] = "attn.k_norm.weight"
        router = {"mlp.gate.weight": "mlp.router.weight"}
        # The shared expert is the decoder layer's own module in the checkpoint
        # (``shared_expert.*``), fed the same normed input as the experts; here it is part of
        # the MoE block.
        return decoder_weight_map(
            tcfg, lambda i: attention | moe_mlp_names(moe, i, router, "shared_expert")
        )


LLADAMOE = LLaDAMoEFamily(
    name="lladamoe",
    bidirectional=True,
    logit_shift=False,
    mask_token="<|mask|>",
    eot_token="<|role_end|>",
    model_types=("llada", "lladamoe"),
    architectures=("LLaDAMoEModelLM", "LLaDAMoEModel"),
    description="LLaDA-MoE-7B-A1B-Base/Instruct (model_type llada with num_experts)",
    extra_stop_tokens=("<|endoftext|>",),
)
