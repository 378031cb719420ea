"""Per-family rules: which config keys mean what, which tensor names map where, and the
diffusion conventions (attention kind, logit shift, positions, mask/EOT token strings).

A family never hard-codes token ids: it names token *strings*, and the loader reads the ids
from the checkpoint's config and tokenizer. :func:`family_for` picks the family from
``config.json`` (``model_type``, then ``architectures``) and refuses everything else.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dllm_serve.models.families.base import Family, UnsupportedModelError
from dllm_serve.models.families.llada import LLADA, LLaDAFamily
from dllm_serve.models.families.llada2 import LLADA2, LLaDA2Family
from dllm_serve.models.families.nemotron import NEMOTRON, NemotronFamily
from dllm_serve.models.families.qwen import (
    DREAM,
    SDAR,
    SDAR_BLOCK,
    QwenFamily,
    SDARBlockFamily,
    SDARFamily,
    is_qwen3_config,
)

__all__ = [
    "DREAM",
    "FAMILIES",
    "LLADA",
    "LLADA2",
    "NEMOTRON",
    "SDAR",
    "SDAR_BLOCK",
    "Family",
    "LLaDA2Family",
    "LLaDAFamily",
    "NemotronFamily",
    "QwenFamily",
    "SDARBlockFamily",
    "SDARFamily",
    "UnsupportedModelError",
    "family_for",
    "supported_summary",
]

FAMILIES: dict[str, Family] = {
    f.name: f for f in (LLADA, DREAM, SDAR_BLOCK, SDAR, LLADA2, NEMOTRON)
}
# The mixture-of-experts families this server implements; every other MoE config is refused.
MOE_FAMILIES: tuple[Family, ...] = (LLADA2,)

# Keys that only mixture-of-experts configs carry.
_MOE_KEYS = (
    "num_experts",
    "moe_num_experts",
    "num_experts_per_tok",
    "moe_topk",
    "n_routed_experts",
)


def supported_summary() -> str:
    """``model_type (checkpoints)`` for every family, for error messages and docs."""
    return "; ".join(f"{'/'.join(f.model_types)} ({f.description})" for f in FAMILIES.values())


def _is_moe(config: Mapping[str, Any]) -> bool:
    archs = config.get("architectures") or []
    model_type = str(config.get("model_type", "")).lower()
    return (
        any("moe" in str(a).lower() for a in archs)
        or "moe" in model_type
        or any(config.get(k) for k in _MOE_KEYS)
    )


def family_for(config: Mapping[str, Any]) -> Family:
    """The :class:`Family` for a checkpoint's ``config.json`` contents.

    Raises :class:`UnsupportedModelError` naming the supported model types for anything else:
    mixture-of-experts configs other than LLaDA2's (LLaDA-MoE also says ``model_type:
    "llada"``), plain autoregressive Qwen3, architectures that exist only as the checkpoint's
    remote code (``auto_map``; this server never runs it), and unknown types.
    """
    supported = supported_summary()
    model_type = config.get("model_type")
    archs = config.get("architectures")
    for family in MOE_FAMILIES:
        if family.matches(config):
            family.check(config)
            return family
    # LLaDA-MoE ships with model_type "llada" too, so this check must come before the lookup.
    if _is_moe(config):
        moe = "; ".join(f"{'/'.join(f.model_types)}" for f in MOE_FAMILIES)
        raise UnsupportedModelError(
            f"mixture-of-experts checkpoints (model_type={model_type!r}, architectures={archs!r}) "
            f"are not supported, except {moe}; supported model types: {supported}"
        )
    for family in FAMILIES.values():
        if family.matches(config):
            family.check(config)
            return family
    if is_qwen3_config(config):
        raise UnsupportedModelError(
            "this is a plain (autoregressive) Qwen3 config; an I-DLM checkpoint stored as qwen3 "
            f"must carry mask_token_id in config.json. Supported model types: {supported}"
        )
    if config.get("auto_map"):
        raise UnsupportedModelError(
            f"model_type {model_type!r} (architectures {archs!r}) is implemented only by the "
            f"checkpoint's own remote code (auto_map {config['auto_map']!r}); dllm-serve never "
            f"runs remote code (trust_remote_code). Supported model types: {supported}"
        )
    raise UnsupportedModelError(
        f"unsupported model_type {model_type!r} (architectures {archs!r}); "
        f"supported model types: {supported}"
    )
