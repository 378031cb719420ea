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
from dllm_serve.models.families.diffusion_gemma import DIFFUSION_GEMMA, DiffusionGemmaFamily
from dllm_serve.models.families.fast_dllm import FAST_DLLM, FastDLLMFamily
from dllm_serve.models.families.llada import LLADA, LLaDAFamily
from dllm_serve.models.families.llada2 import LLADA2, LLaDA2Family
from dllm_serve.models.families.lladamoe import LLADAMOE, LLaDAMoEFamily
from dllm_serve.models.families.nemotron import NEMOTRON, NemotronFamily
from dllm_serve.models.families.qwen import (
    DREAM,
    SDAR,
    SDAR_BLOCK,
    QwenFamily,
    SDARBlockFamily,
    SDARFamily,
    is_qwen3_config,
    regular_causal,
)

__all__ = [
    "DIFFUSION_GEMMA",
    "DREAM",
    "FAMILIES",
    "FAST_DLLM",
    "LLADA",
    "LLADA2",
    "LLADAMOE",
    "NEMOTRON",
    "SDAR",
    "SDAR_BLOCK",
    "DiffusionGemmaFamily",
    "Family",
    "FastDLLMFamily",
    "LLaDA2Family",
    "LLaDAFamily",
    "LLaDAMoEFamily",
    "NemotronFamily",
    "QwenFamily",
    "SDARBlockFamily",
    "SDARFamily",
    "UnsupportedModelError",
    "family_for",
    "supported_summary",
]

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        LLADA, DREAM, SDAR_BLOCK, SDAR, LLADA2, LLADAMOE, FAST_DLLM, NEMOTRON, DIFFUSION_GEMMA
    )
}  # fmt: skip
# The mixture-of-experts families this server implements, matched before the dense ones (LLaDA-MoE
# shares LLaDA-8B's model_type "llada"); every other MoE config is refused.
MOE_FAMILIES: tuple[Family, ...] = (LLADA2, LLADAMOE, DIFFUSION_GEMMA)

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

    The mixture-of-experts families come first: LLaDA-MoE says ``model_type: "llada"`` like
    LLaDA-8B and is told apart by its MoE keys. Raises :class:`UnsupportedModelError` naming the
    supported model types for anything else: other mixture-of-experts configs, plain
    autoregressive Qwen3, architectures that exist only as the checkpoint's remote code
    (``auto_map``; this server never runs it), and unknown types.
    """
    supported = supported_summary()
    model_type = config.get("model_type")
    archs = config.get("architectures")
    for family in MOE_FAMILIES:
        if family.matches(config):
            family.check(config)
            return family
    # Before the dense lookup: an MoE config must never load as the dense family of its type.
    if _is_moe(config):
        moe = "; ".join(f"{'/'.join(f.model_types)} ({f.description})" for f in MOE_FAMILIES)
        raise UnsupportedModelError(
            f"mixture-of-experts checkpoints (model_type={model_type!r}, architectures={archs!r}) "
            f"are not supported, except {moe}; supported model types: {supported}"
        )
    for family in FAMILIES.values():
        if family.matches(config):
            _check_unambiguous(config, family)
            family.check(config)
            return family
    if config.get("bd_size") is not None:
        raise UnsupportedModelError(
            f"config.json has bd_size (Fast-dLLM v2's block) but model_type {model_type!r} "
            f"(architectures {archs!r}); a Fast-dLLM v2 checkpoint says model_type "
            f"'Fast_dLLM_Qwen'. Supported model types: {supported}"
        )
    if is_qwen3_config(config) and regular_causal(config) is False:
        raise UnsupportedModelError(
            "config.json says model_type 'qwen3' with use_regular_causal: false (block-causal "
            "attention): an SDAR block-diffusion checkpoint says model_type 'sdar'. "
            f"Supported model types: {supported}"
        )
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


def _check_unambiguous(config: Mapping[str, Any], family: Family) -> None:
    """Refuse a config that names one family by model_type and another by its block key:
    SDAR and I-DLM would read Fast-dLLM v2's ``bd_size`` as nothing and decode it the wrong
    way (no logit shift, or strictly causal)."""
    if family is not FAST_DLLM and config.get("bd_size") is not None:
        raise UnsupportedModelError(
            f"ambiguous config.json: model_type {config.get('model_type')!r} is the "
            f"{family.name} family, but bd_size is Fast-dLLM v2's block key; a Fast-dLLM v2 "
            "checkpoint says model_type 'Fast_dLLM_Qwen'"
        )
