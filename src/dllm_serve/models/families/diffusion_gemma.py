"""DiffusionGemma (``google/diffusiongemma-26B-A4B-it``; ``model_type: diffusion_gemma``).

A uniform-state diffusion model: the 256-token canvas starts as random token ids and every
step re-draws the positions it does not accept (no mask token is ever used), decoded canvas by
canvas against a causal KV cache (``decoding/renoise.py``). One Gemma-4 mixture-of-experts
stack run in two modes (``models/diffusion_gemma.py``).

config.json: the text model lives in ``text_config`` (``model_type: diffusion_gemma_text``);
the full-attention layers' head size and K/V heads come either as ``global_head_dim`` /
``num_global_key_value_heads`` (the released config) or as ``per_layer_config`` keyed by layer
index (what transformers ≥ 5.25 saves). Dispatch is on ``model_type`` only: the text config
omits Gemma-4 keys such as ``enable_moe_block``, so a Gemma-4 reading would build a dense model.

Tensors: the text stack is ``model.decoder.*`` (tied LM head, no ``lm_head.weight`` on disk);
the encoder's per-layer scalars are ``model.encoder.language_model.layers.N.layer_scalar``
(loaded apart from the decoder's); the vision tower (``model.encoder.vision_tower.*``,
``model.encoder.embed_vision.*``) is present and ignored: this server takes text input only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dllm_serve.models.diffusion_gemma import DiffusionGemmaConfig, GemmaLayerSpec, GemmaRope
from dllm_serve.models.families.base import Family, UnsupportedModelError, positive_int
from dllm_serve.models.transformer import TransformerConfig
from dllm_serve.models.transformer_config import MoEConfig

SLIDING, FULL = "sliding_attention", "full_attention"
DEFAULT_CANVAS = 256  # transformers' DiffusionGemmaConfig.canvas_length default
DEFAULT_SOFTCAP = 30.0  # DiffusionGemmaTextConfig.final_logit_softcapping (a class default)
_LAYER_TENSORS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "router.proj.weight",
    "router.scale",
    "router.per_expert_scale",
    "experts.gate_up_proj",
    "experts.down_proj",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "pre_feedforward_layernorm.weight",
    "post_feedforward_layernorm.weight",
    "post_feedforward_layernorm_1.weight",
    "post_feedforward_layernorm_2.weight",
    "pre_feedforward_layernorm_2.weight",
    "layer_scalar",
)
_IGNORED_PREFIXES = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text model's keys: ``text_config`` when the file nests it, else the file itself."""
    nested = config.get("text_config")
    if nested is None:
        return config
    if not isinstance(nested, Mapping):
        raise UnsupportedModelError("DiffusionGemma config.json: text_config must be an object")
    return nested


def _int(config: Mapping[str, Any], key: str) -> int:
    return positive_int("DiffusionGemma", config, key)


def _rope(params: Mapping[str, Any], layer_type: str) -> GemmaRope:
    if not isinstance(params, Mapping):
        raise UnsupportedModelError(
            f"DiffusionGemma config.json: rope_parameters[{layer_type!r}] must be an object"
        )
    kind = params.get("rope_type", "default")
    theta = float(params.get("rope_theta", 10_000.0 if layer_type == SLIDING else 1_000_000.0))
    factor = float(params.get("partial_rotary_factor", 1.0))
    if kind == "default" and factor != 1.0:
        raise UnsupportedModelError(
            f"DiffusionGemma config.json: {layer_type} default RoPE with partial_rotary_factor "
            f"{factor} is not supported"
        )
    if kind not in ("default", "proportional") or float(params.get("factor", 1.0)) != 1.0:
        raise UnsupportedModelError(
            f"DiffusionGemma config.json: {layer_type} rope {dict(params)!r}; only default and "
            "proportional RoPE (factor 1) are supported"
        )
    return GemmaRope(kind, theta, factor)


def layer_specs(text: Mapping[str, Any]) -> tuple[GemmaLayerSpec, ...]:
    """Each layer's attention from ``layer_types`` (default 5 sliding : 1 full, the last layer
    forced full as transformers does), ``head_dim`` / ``num_key_value_heads`` for sliding layers
    and the full layers' overrides (``global_head_dim`` / ``num_global_key_value_heads``, or
    ``per_layer_config``)."""
    n_layers = _int(text, "num_hidden_layers")
    types = text.get("layer_types")
    if types is None:
        types = [SLIDING if (i + 1) % 6 else FULL for i in range(n_layers)]
    types = list(types)
    if len(types) != n_layers or any(t not in (SLIDING, FULL) for t in types):
        raise UnsupportedModelError(
            f"DiffusionGemma config.json: layer_types must list {n_layers} entries of "
            f"{SLIDING!r} / {FULL!r}, got {types!r}"
        )
    types[-1] = FULL  # transformers forces the last layer to full attention
    head_dim = _int(text, "head_dim")
    kv_heads = _int(text, "num_key_value_heads")
    per_layer = text.get("per_layer_config")
    if per_layer is None:
        # The released form: the overrides apply to every full-attention layer.
        override: dict[str, Any] = {"head_dim": text.get("global_head_dim") or 512}
        if text.get("num_global_key_value_heads") is not None:
            override["num_key_value_heads"] = text["num_global_key_value_heads"]
        per_layer = {str(i): override for i, t in enumerate(types) if t == FULL}
    if not isinstance(per_layer, Mapping):
        raise UnsupportedModelError(
            "DiffusionGemma config.json: per_layer_config must be an object"
        )
    rope_params = text.get("rope_parameters") or {
        SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
    }
    ropes = {t: _rope(rope_params.get(t) or {}, t) for t in (SLIDING, FULL)}
    specs = []
    for i, kind in enumerate(types):
        override = per_layer.get(str(i), per_layer.get(i, {})) or {}
        hd = override.get("head_dim") or head_dim
        kv = override.get("num_key_value_heads") or kv_heads
        for key, value in (("head_dim", hd), ("num_key_value_heads", kv)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UnsupportedModelError(
                    f"DiffusionGemma config.json: layer {i} {key} must be a positive integer, "
                    f"got {value!r}"
                )
        sliding = kind == SLIDING
        # transformers builds v_proj on sliding layers only: full layers are K = V.
        specs.append(GemmaLayerSpec(sliding, hd, kv, not sliding, ropes[kind]))
    return tuple(specs)


@dataclass(frozen=True)
class DiffusionGemmaFamily(Family):
    """DiffusionGemma checkpoints (module docstring)."""

    renoise: bool = True  # decoded by the entropy-bounded renoise sampler (decoding/renoise.py)

    def check(self, config: Mapping[str, Any]) -> None:
        text = text_config(config)
        for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size"):
            _int(text, key)
        for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
            if text.get(key) is None:
                raise UnsupportedModelError(
                    f"DiffusionGemma config.json lacks {key!r}: this server implements the "
                    "mixture-of-experts DiffusionGemma only"
                )
        if text.get("use_bidirectional_attention") not in (None, "vision"):
            raise UnsupportedModelError(
                "DiffusionGemma config.json: use_bidirectional_attention "
                f"{text['use_bidirectional_attention']!r}; only 'vision' (a causal text encoder)"
                " is supported"
            )
        activation = text.get("hidden_activation", "gelu_pytorch_tanh")
        if activation != "gelu_pytorch_tanh":
            raise UnsupportedModelError(
                f"DiffusionGemma config.json: hidden_activation {activation!r}; only "
                "'gelu_pytorch_tanh' is supported"
            )
        if text.get("attention_bias"):
            raise UnsupportedModelError(
                "DiffusionGemma config.json: attention_bias is not supported"
            )
        tie = (config.get("tie_word_embeddings"), text.get("tie_word_embeddings"))
        if False in tie:
            raise UnsupportedModelError(
                "DiffusionGemma config.json: tie_word_embeddings false; the LM head is the "
                "decoder's embedding in every released checkpoint"
            )

    def transformer_config(self, config: Mapping[str, Any]) -> TransformerConfig:
        self.check(config)
        text = text_config(config)
        specs = layer_specs(text)
        n_experts = _int(text, "num_experts")
        moe = MoEConfig(
            num_experts=n_experts,
            top_k=_int(text, "top_k_experts"),
            expert_hidden_size=_int(text, "moe_intermediate_size"),
            shared_hidden_size=0,
            routing="softmax",
            renormalize=True,
            activation="gelu_tanh",
        )
        cap = text.get("final_logit_softcapping", DEFAULT_SOFTCAP)
        canvas = config.get("canvas_length") or DEFAULT_CANVAS
        if isinstance(canvas, bool) or not isinstance(canvas, int) or canvas < 1:
            raise UnsupportedModelError(
                f"DiffusionGemma config.json: canvas_length must be a positive integer, got "
                f"{canvas!r}"
            )
        try:
            return DiffusionGemmaConfig(
                vocab_size=_int(text, "vocab_size"),
                d_model=_int(text, "hidden_size"),
                n_heads=_int(text, "num_attention_heads"),
                n_kv_heads=1,  # the KV pool's slot layout (models/diffusion_gemma.py)
                head_dim=max(s.kv_width for s in specs),
                n_layers=len(specs),
                mlp_hidden_size=_int(text, "intermediate_size"),
                rope_theta=specs[0].rope.theta,
                rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
                tie_embeddings=True,
                max_sequence_length=int(text.get("max_position_embeddings") or 131_072),
                moe=moe,
                layers=specs,
                sliding_window=_int(text, "sliding_window"),
                final_logit_softcapping=None if cap is None else float(cap),
                canvas_length=canvas,
                self_conditioning_size=int(text.get("self_conditioning_size") or 0),
            )
        except ValueError as e:
            raise UnsupportedModelError(f"DiffusionGemma config.json: {e}") from None

    def weight_map(self, tcfg: TransformerConfig) -> dict[str, str]:
        assert isinstance(tcfg, DiffusionGemmaConfig)
        names = {"model.decoder.embed_tokens.weight": "embed_tokens.weight"}
        for i, spec in enumerate(tcfg.layers):
            prefix = f"model.decoder.layers.{i}."
            for t in _LAYER_TENSORS:
                names[prefix + t] = f"layers.{i}.{t}"
            if not spec.k_eq_v:
                names[prefix + "self_attn.v_proj.weight"] = f"layers.{i}.self_attn.v_proj.weight"
            names[f"model.encoder.language_model.layers.{i}.layer_scalar"] = (
                f"layers.{i}.encoder_layer_scalar"
            )
        names["model.decoder.norm.weight"] = "norm.weight"
        names["model.decoder.self_conditioning.pre_norm.weight"] = (
            "self_conditioning.pre_norm.weight"
        )
        for p in ("gate_proj", "up_proj", "down_proj"):
            names[f"model.decoder.self_conditioning.{p}.weight"] = (
                f"self_conditioning.mlp.{p}.weight"
            )
        return names

    def ignorable_tensor(self, name: str, tcfg: TransformerConfig) -> bool:
        # The vision tower (text input only) and a tied head some exports write out.
        if name.startswith(_IGNORED_PREFIXES) or name == "lm_head.weight":
            return True
        return super().ignorable_tensor(name, tcfg)

    def id_config(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """The keys special ids are read from: the text config's, the top level's first."""
        top = {k: v for k, v in config.items() if k != "text_config"}
        return {**dict(text_config(config)), **top}


DIFFUSION_GEMMA = DiffusionGemmaFamily(
    name="diffusion_gemma",
    bidirectional=True,  # the canvas passes; prompt and commits are causal encoder passes
    logit_shift=False,
    mask_token="<mask>",  # in the vocabulary, never used by the sampler (uniform-state)
    eot_token="<turn|>",
    model_types=("diffusion_gemma",),
    architectures=("DiffusionGemmaForBlockDiffusion",),
    description="DiffusionGemma 26B-A4B (uniform-state MoE, entropy-bounded renoise canvases)",
)
