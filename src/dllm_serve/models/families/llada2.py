"""LLaDA2.0 / 2.1 / 2.2 (mini, flash; ``model_type: llada2_moe``): block diffusion on a MoE.

Block-causal attention (bidirectional inside blocks of 32 aligned to position 0, causal
across them), no logit shift, mask ``<|mask|>`` (156895 in the real checkpoints), end of text
``<|endoftext|>`` (156892, also the pad), end of turn ``<|role_end|>``. The network: fused
``query_key_value`` attention with per-head q/k RMSNorm before a partial RoPE, a dense SwiGLU
in the first ``first_k_dense_replace`` layers and a sigmoid-routed, group-limited
mixture-of-experts with a shared expert in the others (``models/routing.py``), untied LM head.

LLaDA2.2 adds three config.json keys (:data:`LLADA22_KEYS`): ``delete_token_id`` and
``split_token_id``, the edit tokens of its insert/delete decoding (JointThresholdInDel,
``decoding/block_diffusion.py``), and ``expert_capacity``, per-block expert admission
(``models/routing.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from dllm_serve.models.families.base import (
    Family,
    UnsupportedModelError,
    check_values,
    positive_int,
    require,
    rope_error,
)
from dllm_serve.models.families.weight_names import decoder_weight_map, moe_mlp_names
from dllm_serve.models.rope import RopeConfigError, parse_rope, partial_rotary_factor
from dllm_serve.models.transformer import TransformerConfig
from dllm_serve.models.transformer_config import MoEConfig

DEFAULT_BLOCK = 32  # the official generate()'s block_length and the published eval setting

# Keys whose every other value describes a network this module does not build. Checked only
# when present: absent means the LLaDA2 default, which is this value.
EXPECTED = (
    ("hidden_act", "silu"),
    ("score_function", "sigmoid"),
    ("moe_router_enable_expert_bias", True),
    ("router_dtype", "fp32"),
    ("use_qkv_bias", False),
    ("use_bias", False),
    ("norm_head", False),
)
# The routing is not guessable: a config without these keys is refused, naming the key.
REQUIRED = (
    "hidden_size",
    "num_attention_heads",
    "num_hidden_layers",
    "vocab_size",
    "intermediate_size",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "first_k_dense_replace",
)


# config.json keys that only LLaDA2.2 declares: its edit tokens (insert/delete decoding,
# decoding/block_diffusion.py) and the experts one routing block may use (models/routing.py).
LLADA22_KEYS = ("delete_token_id", "split_token_id", "expert_capacity")


def _positive_int(config: Mapping[str, Any], key: str, *, zero_ok: bool = False) -> int:
    return positive_int("LLaDA2", config, key, zero_ok=zero_ok)


@dataclass(frozen=True)
class LLaDA2Family(Family):
    """LLaDA2.x MoE block-diffusion checkpoints (see the module docstring)."""

    def check(self, config: Mapping[str, Any]) -> None:
        check_values(self.name, config, EXPECTED)
        self._check_llada22(config)
        for key in REQUIRED:
            require(config, key)
        size = config.get("block_size")
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise UnsupportedModelError(
                f"LLaDA2 config.json: block_size must be a positive integer, got {size!r}"
            )

    @staticmethod
    def _check_llada22(config: Mapping[str, Any]) -> None:
        """LLaDA2.2's keys: the edit tokens come as a pair (the insert/delete decoder needs
        both), and block routing needs the routing block stated in config.json (it must be
        the decoding block: the checkpoint's ``block_size``)."""
        edits = [
            key for key in ("delete_token_id", "split_token_id") if config.get(key) is not None
        ]
        if len(edits) == 1:
            raise UnsupportedModelError(
                f"LLaDA2 config.json declares {edits[0]} alone: LLaDA2.2's insert/delete "
                "decoding needs both delete_token_id and split_token_id"
            )
        for key in edits:
            _positive_int(config, key, zero_ok=True)
        if config.get("expert_capacity") is not None:
            _positive_int(config, "expert_capacity")
            if config.get("block_size") is None:
                raise UnsupportedModelError(
                    "LLaDA2 config.json declares expert_capacity (block routing) without "
                    "block_size: the routing block must be stated, and equal the decoding block"
                )

    def edit_tokens(
        self, config: Mapping[str, Any], vocab_size: int, mask_id: int
    ) -> tuple[int, int] | None:
        """LLaDA2.2's ``(DELETE, SPLIT)`` edit-token ids, or None for LLaDA2.0/2.1. They must
        be rows of the vocabulary, distinct, and not the mask (the decoder tells a mask, a
        deletion and an insertion apart by id)."""
        if config.get("delete_token_id") is None:
            return None
        delete, split = int(config["delete_token_id"]), int(config["split_token_id"])
        for key, value in (("delete_token_id", delete), ("split_token_id", split)):
            if not 0 <= value < vocab_size:
                raise UnsupportedModelError(
                    f"LLaDA2 config.json: {key} {value} is outside the vocabulary "
                    f"(0 .. {vocab_size - 1})"
                )
            if value == mask_id:
                raise UnsupportedModelError(
                    f"LLaDA2 config.json: {key} {value} is the mask id: an edit token must be "
                    "its own token"
                )
        if delete == split:
            raise UnsupportedModelError(
                f"LLaDA2 config.json: delete_token_id and split_token_id are both {delete}"
            )
        return delete, split

    def transformer_config(self, config: Mapping[str, Any]) -> TransformerConfig:
        self.check(config)
        d_model = _positive_int(config, "hidden_size")
        n_heads = _positive_int(config, "num_attention_heads")
        n_layers = _positive_int(config, "num_hidden_layers")
        head_dim = int(config.get("head_dim") or d_model // n_heads)
        max_len = int(config.get("max_position_embeddings") or 32768)
        try:
            theta, scaling = parse_rope(config, max_len, allow_partial=True)
            rotary_dim = int(head_dim * partial_rotary_factor(config))
        except RopeConfigError as e:
            raise rope_error(e) from None
        # The released configs also state rotary_dim; it must agree with the factor.
        if config.get("rotary_dim") is not None and config["rotary_dim"] != rotary_dim:
            raise UnsupportedModelError(
                f"LLaDA2 config.json: rotary_dim {config['rotary_dim']!r} disagrees with "
                f"head_dim {head_dim} × partial_rotary_factor ({rotary_dim})"
            )
        first_dense = _positive_int(config, "first_k_dense_replace", zero_ok=True)
        if first_dense > n_layers:
            raise UnsupportedModelError(
                f"LLaDA2 config.json: first_k_dense_replace {first_dense} exceeds "
                f"num_hidden_layers {n_layers}"
            )
        expert_width = _positive_int(config, "moe_intermediate_size")
        shared = int(config.get("num_shared_experts") or 0)
        try:
            moe = MoEConfig(
                routing="sigmoid_group_limited",
                num_experts=_positive_int(config, "num_experts"),
                top_k=_positive_int(config, "num_experts_per_tok"),
                n_group=_positive_int(config, "n_group"),
                topk_group=_positive_int(config, "topk_group"),
                expert_hidden_size=expert_width,
                shared_hidden_size=expert_width * shared,
                routed_scaling_factor=float(config["routed_scaling_factor"]),
                first_dense_layers=first_dense,
                renormalize=bool(config.get("norm_topk_prob", True)),
                # LLaDA2.2: experts admitted per block of block_size positions (routing.py).
                expert_capacity=config.get("expert_capacity"),
                routing_block=int(config.get("block_size") or 0),
            )
            return TransformerConfig(
                vocab_size=_positive_int(config, "vocab_size"),
                d_model=d_model,
                n_heads=n_heads,
                n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
                n_layers=n_layers,
                mlp_hidden_size=_positive_int(config, "intermediate_size"),
                rope_theta=theta,
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                tie_embeddings=bool(config.get("tie_word_embeddings", False)),
                max_sequence_length=max_len,
                head_dim=head_dim,
                # HF's config class defaults use_qk_norm to false, yet the released models
                # are trained with the norms (dFactory builds them unconditionally; SGLang
                # defaults the flag to true): absent means on. ``with_tensors`` has the last
                # word, from the tensors the checkpoint actually holds.
                qk_norm=config.get("use_qk_norm") is not False,
                rope_scaling=scaling,
                rotary_dim=rotary_dim,
                fused_qkv=True,
                moe=moe,
            )
        except UnsupportedModelError:
            raise
        except ValueError as e:  # inconsistent sizes: say so as an unsupported config
            raise UnsupportedModelError(f"LLaDA2 config.json: {e}") from None

    def with_tensors(
        self, config: Mapping[str, Any], tcfg: TransformerConfig, names: set[str]
    ) -> TransformerConfig:
        # Norm weights in the checkpoint switch the norms on whatever use_qk_norm says (dFactory
        # applies them unconditionally); without them they are off unless the config says
        # use_qk_norm: true, in which case the missing tensors are reported by name.
        has_norms = any(n.endswith("attention.query_layernorm.weight") for n in names)
        qk_norm = has_norms or config.get("use_qk_norm") is True
        return replace(tcfg, qk_norm=qk_norm) if qk_norm != tcfg.qk_norm else tcfg

    def block_size(self, config: Mapping[str, Any], block_length: int | None) -> int | None:
        return int(config.get("block_size") or block_length or DEFAULT_BLOCK)

    def weight_map(self, tcfg: TransformerConfig) -> dict[str, str]:
        moe = tcfg.moe
        assert moe is not None
        attention = {
            "input_layernorm.weight": "attn_norm.weight",
            "attention.query_key_value.weight": "attn.qkv_proj.weight",
            "attention.dense.weight": "attn.o_proj.weight",
            "post_attention_layernorm.weight": "mlp_norm.weight",
        }
        if tcfg.qk_norm:
            attention["attention.query_layernorm.weight"] = "attn.q_norm.weight"
            attention["attention.key_layernorm.weight"] = "attn.k_norm.weight"
        router = {
            "mlp.gate.weight": "mlp.router.weight",
            "mlp.gate.expert_bias": "mlp.router.expert_bias",
        }
        return decoder_weight_map(
            tcfg,
            lambda i: attention | moe_mlp_names(moe, i, router, "mlp.shared_experts"),
            embed="word_embeddings",
        )


LLADA2 = LLaDA2Family(
    name="llada2",
    bidirectional=True,  # inside a block; causal across blocks (block_diffusion)
    logit_shift=False,
    mask_token="<|mask|>",
    eot_token="<|role_end|>",
    model_types=("llada2_moe",),
    architectures=("LLaDA2MoeModelLM",),
    description="LLaDA2.0/2.1/2.2 mini and flash (MoE block diffusion)",
    extra_stop_tokens=("<|endoftext|>",),
    block_diffusion=True,
    # LLaDA2.1 (same format as 2.0): JointThreshold per request; LLaDA2.2 (edit tokens in
    # config.json): JointThresholdInDel.
    token_editing=True,
)
