"""The network a :class:`TransformerConfig` describes: the shared :class:`DecoderTransformer`,
or DiffusionGemma's two-mode Gemma-4 stack for a :class:`DiffusionGemmaConfig`."""

from __future__ import annotations

from torch import nn

from dllm_serve.models.diffusion_gemma import DiffusionGemmaConfig, DiffusionGemmaModel
from dllm_serve.models.transformer import DecoderTransformer
from dllm_serve.models.transformer_config import TransformerConfig


def build_network(tcfg: TransformerConfig) -> nn.Module:
    """The module for ``tcfg`` (on the current default device: the loader builds it on meta)."""
    if isinstance(tcfg, DiffusionGemmaConfig):
        return DiffusionGemmaModel(tcfg)
    return DecoderTransformer(tcfg)
