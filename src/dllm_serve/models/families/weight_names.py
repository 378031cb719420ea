"""Checkpoint tensor names → ``DecoderTransformer`` names, for the layouts several families share.

Most of our checkpoints store a transformers-style decoder: an embedding, ``N`` numbered
layers, a final norm and an untied head, with the Llama names inside each layer. The families
differ in prefixes and in what a layer holds (biases, q/k norms, a mixture of experts), which
they pass in; the walk over the layers is written once here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from dllm_serve.models.transformer import TransformerConfig
from dllm_serve.models.transformer_config import MoEConfig

SWIGLU = ("gate_proj", "up_proj", "down_proj")

# One Llama/Qwen/Mistral decoder layer with separate q/k/v/o projections and a dense SwiGLU.
LLAMA_LAYER: dict[str, str] = {
    "input_layernorm.weight": "attn_norm.weight",
    **{f"self_attn.{p}_proj.weight": f"attn.{p}_proj.weight" for p in "qkvo"},
    "post_attention_layernorm.weight": "mlp_norm.weight",
    **{f"mlp.{p}.weight": f"mlp.{p}.weight" for p in SWIGLU},
}


def decoder_weight_map(
    tcfg: TransformerConfig,
    layer: Mapping[str, str] | Callable[[int], Mapping[str, str]],
    *,
    prefix: str = "model",
    embed: str = "embed_tokens",
    head: str = "lm_head",
) -> dict[str, str]:
    """``{prefix}.{embed}``, ``{prefix}.layers.N.*`` (``layer``: the same names for every
    layer, or a function of the layer index), ``{prefix}.norm`` and, when untied, ``{head}``."""
    names = {f"{prefix}.{embed}.weight": "embed_tokens.weight"}
    for i in range(tcfg.n_layers):
        for theirs, ours in (layer(i) if callable(layer) else layer).items():
            names[f"{prefix}.layers.{i}.{theirs}"] = f"layers.{i}.{ours}"
    names[f"{prefix}.norm.weight"] = "norm.weight"
    if not tcfg.tie_embeddings:
        names[f"{head}.weight"] = "head.weight"
    return names


def moe_mlp_names(
    moe: MoEConfig, layer: int, router: Mapping[str, str], shared_prefix: str
) -> dict[str, str]:
    """One layer's MLP tensors: a dense SwiGLU, or on a mixture-of-experts layer the router
    (``router``: its tensors, ours under ``mlp.router``), per-expert SwiGLUs
    ``mlp.experts.E.*`` and, when the config has one, the shared expert
    (``{shared_prefix}.*``, ours under ``mlp.shared``)."""
    if not moe.is_moe_layer(layer):
        return {f"mlp.{p}.weight": f"mlp.{p}.weight" for p in SWIGLU}
    names = dict(router)
    for e in range(moe.num_experts):
        for p in SWIGLU:
            names[f"mlp.experts.{e}.{p}.weight"] = f"mlp.experts.{e}.{p}.weight"
    if moe.shared_hidden_size:
        for p in SWIGLU:
            names[f"{shared_prefix}.{p}.weight"] = f"mlp.shared.{p}.weight"
    return names
