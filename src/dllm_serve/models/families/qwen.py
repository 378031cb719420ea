"""Families stored in Qwen's transformers format: Dream (Qwen2), I-DLM and SDAR (Qwen3).

All use the HF ``model.layers.N.self_attn.q_proj``… tensor names. They differ in attention
(Dream is bidirectional, I-DLM strictly causal, SDAR block-causal), in the logit shift (Dream
and I-DLM read position ``j`` from the output at ``j - 1``; SDAR does not), in q/k/v biases
(Qwen2) versus per-head q/k RMSNorm (Qwen3), and in their mask token. Fast-dLLM v2 (Qwen2
weights, block-causal, shifted) lives in ``fast_dllm.py``.
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
from dllm_serve.models.rope import RopeConfigError, parse_rope
from dllm_serve.models.transformer import TransformerConfig


@dataclass(frozen=True)
class QwenFamily(Family):
    """A Qwen2/Qwen3-format checkpoint (config keys and tensor names as in transformers)."""

    qkv_bias: bool = False  # Qwen2: always; Qwen3: when attention_bias
    qk_norm: bool = False  # Qwen3

    # Keys that would change the network, checked when present (absent = Qwen's default).
    EXPECTED = (
        ("hidden_act", "silu"),
        ("use_sliding_window", False),
        ("use_mrope", False),
        ("mlp_bias", False),
    )

    def check(self, config: Mapping[str, Any]) -> None:
        check_values(self.name, config, self.EXPECTED)

    def transformer_config(self, config: Mapping[str, Any]) -> TransformerConfig:
        self.check(config)
        d_model = int(require(config, "hidden_size"))
        n_heads = int(require(config, "num_attention_heads"))
        max_len = int(config.get("max_position_embeddings") or 32768)  # Qwen2/3 default
        try:
            theta, scaling = parse_rope(config, max_len)
        except RopeConfigError as e:
            raise rope_error(e) from None
        # Only Qwen3 reads attention_bias (then q/k/v *and* o are biased); Qwen2 always has
        # q/k/v biases and never an o bias, whatever its config says.
        attention_bias = self.qk_norm and bool(config.get("attention_bias", False))
        return TransformerConfig(
            vocab_size=int(require(config, "vocab_size")),
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
            n_layers=int(require(config, "num_hidden_layers")),
            mlp_hidden_size=int(require(config, "intermediate_size")),
            rope_theta=theta,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_sequence_length=max_len,
            head_dim=int(config.get("head_dim") or d_model // n_heads),
            qkv_bias=self.qkv_bias or attention_bias,
            o_bias=attention_bias,
            qk_norm=self.qk_norm,
            rope_scaling=scaling,
        )

    def weight_map(self, tcfg: TransformerConfig) -> dict[str, str]:
        per_layer = dict(LLAMA_LAYER)
        if tcfg.qkv_bias:
            for p in "qkv":
                per_layer[f"self_attn.{p}_proj.bias"] = f"attn.{p}_proj.bias"
        if tcfg.o_bias:
            per_layer["self_attn.o_proj.bias"] = "attn.o_proj.bias"
        if tcfg.qk_norm:
            per_layer["self_attn.q_norm.weight"] = "attn.q_norm.weight"
            per_layer["self_attn.k_norm.weight"] = "attn.k_norm.weight"
        return decoder_weight_map(tcfg, per_layer)

    def ignorable_tensor(self, name: str, tcfg: TransformerConfig) -> bool:
        # Some exports of tied checkpoints still write the (identical) LM head.
        return super().ignorable_tensor(name, tcfg) or (
            tcfg.tie_embeddings and name == "lm_head.weight"
        )


def is_qwen3_config(config: Mapping[str, Any]) -> bool:
    """Whether ``config.json`` describes a transformers Qwen3 model (by type, else by arch)."""
    model_type = config.get("model_type")
    if model_type:
        return str(model_type).lower() == "qwen3"
    return "Qwen3ForCausalLM" in (config.get("architectures") or [])


# Keys of SDAR's own training framework that its released configs carry (JetAstra/SDAR
# ``training/model/SDAR-{4B,8B}-Chat/config.json``) and I-DLM's do not.
SDAR_RELEASE_KEYS = ("ep_size", "use_deepep", "micro_forward", "skip_checkpoint")


def is_sdar_block_config(config: Mapping[str, Any]) -> bool:
    """Whether a ``model_type: sdar`` config is SDAR/TraDo block diffusion rather than I-DLM.

    Both ship the same model_type, architecture, tensor names, mask token, ``block_size`` and
    ``attn_implementation``; what differs is the attention they were trained with, which only
    their remote code states. ``use_regular_causal`` says it when present (I-DLM's SDARConfig
    defaults it to true, strict causality; false is block-causal). SDAR's own SDARConfig has no
    such key, so its released configs omit it — but they carry its training framework's keys
    (:data:`SDAR_RELEASE_KEYS`), which I-DLM's do not. Neither: I-DLM (its config class's
    default).
    """
    explicit = regular_causal(config)
    if explicit is not None:
        return explicit is False
    return any(key in config for key in SDAR_RELEASE_KEYS)


def regular_causal(config: Mapping[str, Any]) -> bool | None:
    """``use_regular_causal`` of ``config`` (None: absent); a value that is not a JSON boolean
    is refused (the string "false" is truthy: SDAR would load as I-DLM)."""
    value = config.get("use_regular_causal")
    if value is not None and not isinstance(value, bool):
        raise UnsupportedModelError(
            f"config.json use_regular_causal must be true (I-DLM, strictly causal) or false "
            f"(SDAR block diffusion), got {value!r}"
        )
    return value


@dataclass(frozen=True)
class SDARFamily(QwenFamily):
    """I-DLM / SDAR: Qwen3 weights, strictly causal, logit shift, mask ``<|MASK|>``."""

    def matches(self, config: Mapping[str, Any]) -> bool:
        # SDAR's block-bidirectional checkpoints (SDAR_BLOCK) share model_type sdar.
        if super().matches(config):
            return not is_sdar_block_config(config)
        # I-DLM may also be published as a plain Qwen3 config; the diffusion mask id is what
        # tells it apart from an autoregressive Qwen3.
        return (
            is_qwen3_config(config)
            and "mask_token_id" in config
            and regular_causal(config) is not False
        )


@dataclass(frozen=True)
class SDARBlockFamily(QwenFamily):
    """SDAR / TraDo block diffusion: Qwen3 weights, block-causal attention, no logit shift.

    It shares ``model_type: sdar`` and the tensor names with I-DLM; what differs is the
    attention the checkpoint was trained with (:func:`is_sdar_block_config`).
    """

    def matches(self, config: Mapping[str, Any]) -> bool:
        return super().matches(config) and is_sdar_block_config(config)

    def check(self, config: Mapping[str, Any]) -> None:
        super().check(config)
        size = config.get("block_size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise UnsupportedModelError(
                f"an SDAR block-diffusion config needs a positive integer block_size, got {size!r}"
            )


SDAR_BLOCK = SDARBlockFamily(
    name="sdar_block",
    bidirectional=True,  # inside a block; causal across blocks (block_diffusion)
    logit_shift=False,
    mask_token="<|MASK|>",
    eot_token="<|im_end|>",
    model_types=("sdar",),
    architectures=("SDARForCausalLM",),
    description="SDAR-Chat/TraDo block diffusion: model_type sdar, block-causal",
    extra_stop_tokens=("<|endoftext|>",),
    tokenizer_class="Qwen2Tokenizer",
    qk_norm=True,
    block_diffusion=True,
)

DREAM = QwenFamily(
    name="dream",
    bidirectional=True,
    logit_shift=True,
    mask_token="<|mask|>",
    eot_token="<|im_end|>",
    model_types=("dream",),
    architectures=("DreamModel",),
    description="Dream-v0-Base/Instruct-7B",
    tokenizer_class="Qwen2Tokenizer",
    qkv_bias=True,
)

SDAR = SDARFamily(
    name="sdar",
    bidirectional=False,
    logit_shift=True,
    mask_token="<|MASK|>",
    eot_token="<|im_end|>",
    model_types=("sdar",),
    architectures=("SDARForCausalLM",),
    description="I-DLM-8B/32B; also model_type qwen3 with mask_token_id",
    extra_stop_tokens=("<|endoftext|>",),
    tokenizer_class="Qwen2Tokenizer",
    qk_norm=True,
)
