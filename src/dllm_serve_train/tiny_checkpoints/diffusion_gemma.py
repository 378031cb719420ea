"""Tiny random-weight checkpoints in DiffusionGemma's on-disk format (``diffusion_gemma``).

``config.json`` has the released file's layout (``text_config`` of ``model_type:
diffusion_gemma_text`` with ``global_head_dim`` / ``num_global_key_value_heads``, a Gemma-4
``vision_config``, ``canvas_length``) at small sizes; ``generation_config.json`` carries the
released sampler settings (``max_denoising_steps`` 48, entropy bound 0.1, t 0.8 → 0.4,
confidence threshold 0.005, stability 1) and the EOS set ``<eos>``, ``<turn|>``,
``<|tool_response>``. The weights use the real names: the text stack under
``model.decoder.*`` (tied head, no ``lm_head.weight``), the encoder's per-layer
``layer_scalar`` apart (set to other values than the decoder's, so a loader that merges them
is caught), and a one-layer vision tower the server ignores. The tokenizer is the shared
small byte-level BPE plus Gemma's special tokens right after it (the real ids — pad 0, eos 1,
bos 2, mask 4, ``<turn|>`` 106 — need the real 262144-row vocabulary), with Gemma 4's
``<|turn>role … <turn|>`` chat format. Output is a pure function of the arguments.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dllm_serve.models.families import DIFFUSION_GEMMA
from dllm_serve.models.network import build_network
from dllm_serve_train.tiny_checkpoints.bpe import base_vocab_size, build_tokenizer
from dllm_serve_train.tiny_checkpoints.files import (
    FLAGS,
    make_dir,
    readable,
    round_up,
    save_weights,
)
from dllm_serve_train.tiny_checkpoints.files import write_json as _write_json
from dllm_serve_train.tiny_checkpoints.files import write_text as _write_text

SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>", "<|tool_response>")
# Gemma 4's turn format; the template writes <bos> itself (the loader encodes the rendered
# prompt without adding specials).
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{- '<|turn>' + role + '\\n' + message['content'] + '<turn|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|turn>model\\n' -}}{%- endif -%}"
)
# The released generation_config.json's sampler settings (reference diffusiongemma.md §2.2).
SAMPLER = {
    "max_denoising_steps": 48,
    "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.1},
    "confidence_threshold": 0.005,
    "stability_threshold": 1,
    "t_max": 0.8,
    "t_min": 0.4,
}
VISION = 16  # the tiny vision tower's width (ignored by the server; transformers loads it)

CARD = """\
# {name}

A tiny **random-weight** checkpoint in the on-disk format of google/diffusiongemma-26B-A4B-it
(`model_type: diffusion_gemma`). Made by `dllm-serve make-tiny --family diffusion_gemma` for
tests and demos; its answers are gibberish.

- Text: hidden {d_model}, {n_layers} layers ({types}), {n_heads} heads; sliding layers
  {kv} KV heads of {head_dim}, window {window}; full layers {gkv} KV head(s) of {ghd}, K = V;
  dense GeGLU {mlp} and {experts} experts of width {expert} (top-{top_k}) in every layer;
  {params:,} text parameters, bf16. Canvas {canvas} tokens.
- Vocabulary: {vocab} rows; byte-level BPE then {specials} at ids {first}-{last}
  (EOS set {eos}).
- Weights: norms ones, layer scalars {dec_scalar} (decoder) / {enc_scalar} (encoder), everything
  else `randn * 0.02` from `torch.Generator` seed {seed}; a one-layer vision tower (ignored).
"""


def _vision_config(intermediate: int) -> dict[str, Any]:
    return {
        "model_type": "gemma4_vision", "hidden_size": VISION, "intermediate_size": intermediate,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
        "head_dim": 8, "patch_size": 4, "pooling_kernel_size": 3, "position_embedding_size": 64,
        "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_theta": 100.0, "rope_type": "axial"},
        "standardize": False, "use_clipped_linears": False, "attention_bias": False,
    }  # fmt: skip


def _vision_shapes(d_model: int, intermediate: int) -> dict[str, tuple[int, ...]]:
    layer = "model.encoder.vision_tower.encoder.layers.0."
    shapes: dict[str, tuple[int, ...]] = {
        "model.encoder.embed_vision.embedding_projection.weight": (d_model, VISION),
        "model.encoder.vision_tower.patch_embedder.input_proj.weight": (VISION, 3 * 4 * 4),
        "model.encoder.vision_tower.patch_embedder.position_embedding_table": (2, 64, VISION),
    }
    for norm in (
        "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    ):  # fmt: skip
        shapes[f"{layer}{norm}.weight"] = (VISION,)
    shapes[f"{layer}mlp.gate_proj.linear.weight"] = (intermediate, VISION)
    shapes[f"{layer}mlp.up_proj.linear.weight"] = (intermediate, VISION)
    shapes[f"{layer}mlp.down_proj.linear.weight"] = (VISION, intermediate)
    for p in "qkvo":
        shapes[f"{layer}self_attn.{p}_proj.linear.weight"] = (VISION, VISION)
    shapes[f"{layer}self_attn.q_norm.weight"] = (8,)
    shapes[f"{layer}self_attn.k_norm.weight"] = (8,)
    return shapes


def write_tiny_diffusion_gemma(
    out_dir: str | Path,
    *,
    d_model: int = 64,
    n_layers: int = 4,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    head_dim: int = 16,
    global_head_dim: int = 32,
    global_kv_heads: int = 1,
    sliding_window: int = 16,
    mlp_hidden_size: int = 96,
    num_experts: int = 8,
    experts_per_token: int = 2,
    expert_hidden_size: int = 16,
    canvas_length: int = 32,
    max_sequence_length: int = 4096,
    seed: int = 0,
    num_shards: int = 1,
) -> Path:
    """Write a complete DiffusionGemma-format checkpoint and return its path.

    Layers follow the real 5 sliding : 1 full pattern with the last layer full (4 layers:
    sliding, sliding, sliding, full).
    """
    out = Path(out_dir)
    make_dir(out)
    first = base_vocab_size()
    ids = {t: first + i for i, t in enumerate(SPECIALS)}
    tok = build_tokenizer(SPECIALS)
    assert all(tok.token_to_id(t) == i for t, i in ids.items())
    vocab = round_up(first + len(SPECIALS))
    eos_set = [ids["<eos>"], ids["<turn|>"], ids["<|tool_response>"]]
    types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n_layers)]
    types[-1] = "full_attention"
    text = {
        "model_type": "diffusion_gemma_text", "vocab_size": vocab, "hidden_size": d_model,
        "intermediate_size": mlp_hidden_size, "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads, "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim, "global_head_dim": global_head_dim,
        "num_global_key_value_heads": global_kv_heads, "layer_types": types,
        "sliding_window": sliding_window, "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-06, "max_position_embeddings": max_sequence_length,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {
                "rope_type": "proportional", "partial_rotary_factor": 0.25,
                "rope_theta": 1000000.0,
            },
        },
        "final_logit_softcapping": 30.0, "num_experts": num_experts,
        "top_k_experts": experts_per_token, "moe_intermediate_size": expert_hidden_size,
        "use_bidirectional_attention": "vision", "attention_bias": False,
        "tie_word_embeddings": True, "pad_token_id": ids["<pad>"],
        "eos_token_id": ids["<eos>"], "bos_token_id": ids["<bos>"],
    }  # fmt: skip
    config = {
        "architectures": ["DiffusionGemmaForBlockDiffusion"], "model_type": "diffusion_gemma",
        "canvas_length": canvas_length, "text_config": text,
        "vision_config": _vision_config(2 * VISION), "tie_word_embeddings": True,
        "boi_token_id": 255999, "eoi_token_id": 258882, "image_token_id": 258880,
        "eos_token_id": eos_set[:2], "dtype": "bfloat16",
    }  # fmt: skip
    _write_json(out / "config.json", config)
    gen = {
        **SAMPLER, "max_new_tokens": canvas_length, "eos_token_id": eos_set,
        "pad_token_id": ids["<pad>"], "bos_token_id": ids["<bos>"],
    }  # fmt: skip
    _write_json(out / "generation_config.json", gen)
    _write_json(out / "tokenizer_config.json", _tokenizer_config(first, max_sequence_length))
    _write_json(out / "special_tokens_map.json", _special_tokens_map())
    tok.save(str(out / "tokenizer.json"))
    readable(out / "tokenizer.json")

    tcfg = DIFFUSION_GEMMA.transformer_config(config)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in build_network(tcfg).state_dict().items()}
    gen_ = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    dec_scalar, enc_scalar = 1.25, 0.75  # apart: a loader that merges them is caught
    # Drawn in the family's fixed name order, so the same seed gives the same tensors.
    for theirs, ours in DIFFUSION_GEMMA.weight_map(tcfg).items():
        shape = shapes[ours]
        if ours.endswith("encoder_layer_scalar"):
            t = torch.full(shape, enc_scalar)
        elif ours.endswith("layer_scalar"):
            t = torch.full(shape, dec_scalar)
        elif ours.endswith(("norm.weight", "router.scale", "router.per_expert_scale")):
            t = torch.ones(shape)
        else:
            t = torch.randn(shape, generator=gen_) * 0.02
        tensors[theirs] = t.to(torch.bfloat16).contiguous()
    params = sum(t.numel() for t in tensors.values())
    for name, shape in _vision_shapes(d_model, 2 * VISION).items():
        fill = torch.ones(shape) if name.endswith("norm.weight") else None
        t = fill if fill is not None else torch.randn(shape, generator=gen_) * 0.02
        tensors[name] = t.to(torch.bfloat16).contiguous()
    save_weights(out, tensors, num_shards)
    _write_text(out / "README.md", CARD.format(
        name=out.name, d_model=d_model, n_layers=n_layers,
        types=", ".join(t.split("_")[0] for t in types), n_heads=n_heads, kv=n_kv_heads,
        head_dim=head_dim, window=sliding_window, gkv=global_kv_heads, ghd=global_head_dim,
        mlp=mlp_hidden_size, experts=num_experts, expert=expert_hidden_size,
        top_k=experts_per_token, params=params, canvas=canvas_length, vocab=vocab,
        specials=", ".join(f"`{t}`" for t in SPECIALS), first=first,
        last=first + len(SPECIALS) - 1, eos=eos_set, dec_scalar=dec_scalar,
        enc_scalar=enc_scalar, seed=seed,
    ))  # fmt: skip
    return out


def _tokenizer_config(first: int, max_len: int) -> dict[str, Any]:
    return {
        "add_bos_token": True, "add_eos_token": False,
        "added_tokens_decoder": {
            str(first + i): {"content": t, **FLAGS, "special": True}
            for i, t in enumerate(SPECIALS)
        },
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
        "mask_token": "<mask>", "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False, "model_max_length": max_len,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }  # fmt: skip


def _special_tokens_map() -> dict[str, Any]:
    return {
        name: {"content": token, **FLAGS}
        for name, token in (
            ("bos_token", "<bos>"), ("eos_token", "<eos>"), ("pad_token", "<pad>"),
            ("unk_token", "<unk>"), ("mask_token", "<mask>"),
        )
    }  # fmt: skip
