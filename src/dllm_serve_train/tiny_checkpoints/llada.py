"""Tiny random-weight checkpoints in the exact LLaDA-8B-Instruct on-disk format.

The vocabulary is small (the shared byte-level BPE) but carries all 269 real LLaDA special
tokens, moved as one contiguous block to just after the base vocabulary (or kept at their real
ids 126080-126348 with ``real_ids``); every id in the JSON files is moved consistently.
Everything else (the 46 config keys, the tokenizer config, the chat template) is reproduced
field for field, so the loader is exercised on the real format. Output is a pure function of
the arguments.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dllm_serve.models.families import LLADA
from dllm_serve_train.tiny_checkpoints.bpe import base_vocab_size, build_tokenizer
from dllm_serve_train.tiny_checkpoints.files import FLAGS as _FLAGS
from dllm_serve_train.tiny_checkpoints.files import (
    make_dir,
    random_weights,
    readable,
    round_up,
    save_weights,
    write_text,
)
from dllm_serve_train.tiny_checkpoints.files import write_json as _write_json

REAL_FIRST_ID = 126080  # <|startoftext|> in the real checkpoint
REAL_VOCAB = 126464


def llada_special_tokens() -> list[str]:
    """The 269 added tokens of LLaDA-8B-Instruct, in id order (real ids 126080-126348)."""
    reserved = [f"<|reserved_token_{i}|>" for i in range(256)]
    reserved[252] = "<|mdm_mask|>"  # LLaDA repurposed reserved_token_252 as the diffusion mask
    return [
        "<|startoftext|>", "<|endoftext|>", "[CLS]", "[gMASK]", *reserved,
        "<role>", "</role>", "<|arithmetic_start|>", "<|arithmetic_end|>",
        "<|number_start|>", "<|number_end|>", "<|start_header_id|>", "<|end_header_id|>",
        "<|eot_id|>",
    ]  # fmt: skip


CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
)


def _real_config(sizes: dict[str, int], ids: dict[str, int]) -> dict[str, Any]:
    """LLaDA-8B-Instruct's config.json (all 46 keys, same order) with sizes and ids replaced."""
    cfg: dict[str, Any] = {
        "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0,
        "architectures": ["LLaDAModelLM"], "attention_dropout": 0.0,
        "attention_layer_norm": False, "attention_layer_norm_with_affine": True,
        "auto_map": {
            "AutoConfig": "configuration_llada.LLaDAConfig",
            "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
            "AutoModel": "modeling_llada.LLaDAModelLM",
        },
        "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama",
        "d_model": 4096, "embedding_dropout": 0.0, "embedding_size": 126464,
        "eos_token_id": 126081, "flash_attention": False, "include_bias": False,
        "include_qkv_bias": False, "init_cutoff_factor": None, "init_device": "meta",
        "init_fn": "mitchell", "init_std": 0.02, "input_emb_norm": False,
        "layer_norm_type": "rms", "layer_norm_with_affine": True, "mask_token_id": 126336,
        "max_sequence_length": 4096, "mlp_hidden_size": 12288, "mlp_ratio": 4,
        "model_type": "llada", "multi_query_attention": None, "n_heads": 32,
        "n_kv_heads": 32, "n_layers": 32, "pad_token_id": 126081, "precision": "amp_bf16",
        "residual_dropout": 0.0, "rms_norm_eps": 1e-05, "rope": True,
        "rope_full_precision": True, "rope_theta": 500000.0, "scale_logits": False,
        "transformers_version": "4.46.3", "use_cache": False, "vocab_size": 126464,
        "weight_tying": False,
    }  # fmt: skip
    assert set(sizes) | set(ids) <= set(cfg)
    return {**cfg, **sizes, **ids}


_ADDITIONAL = ["<role>", "</role>", "<|arithmetic_start|>", "<|arithmetic_end|>",
               "<|number_start|>", "<|number_end|>"]  # fmt: skip


def _tokenizer_config(specials: list[str], first_id: int) -> dict[str, Any]:
    """LLaDA-8B-Instruct's tokenizer_config.json, field for field, with the ids moved."""
    added = {str(first_id + i): {"content": t, **_FLAGS, "special": True}
             for i, t in enumerate(specials)}  # fmt: skip
    return {
        "add_bos_token": False, "add_eos_token": False, "added_tokens_decoder": added,
        "additional_special_tokens": _ADDITIONAL, "bos_token": "<|startoftext|>",
        "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
        "cls_token": "[CLS]", "eos_token": "<|endoftext|>", "fast_tokenizer": True,
        "gmask_token": "[gMASK]", "merges_file": None,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 1000000000000000019884624838656, "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        # In the real file too; inert (no remote tokenizer code exists) and never honoured here.
        "trust_remote_code": True, "vocab_file": None,
    }  # fmt: skip


def _special_tokens_map() -> dict[str, Any]:
    def entry(t: str) -> dict[str, Any]:
        return {"content": t, **_FLAGS}

    return {
        "additional_special_tokens": _ADDITIONAL, "bos_token": entry("<|startoftext|>"),
        "cls_token": entry("[CLS]"), "eos_token": entry("<|endoftext|>"),
        "pad_token": entry("<|endoftext|>"),
    }  # fmt: skip


MODEL_CARD = """\
# tiny-llada

A tiny **random-weight** checkpoint in the exact on-disk format of GSAI-ML/LLaDA-8B-Instruct.
It exists so that dllm-serve runs, and its tests exercise the real loader, tokenizer and chat
template, with no download and no GPU. Its answers are gibberish: it was never trained.

- Shape: d_model {d_model}, {n_layers} layers, {n_heads} heads (MHA), SwiGLU MLP {mlp},
  RoPE theta 500000, untied LM head, max_sequence_length {max_len}; {params:,} parameters in bf16.
- Vocabulary: {vocab} rows. A byte-level BPE (256 bytes + {merges} merges learned from a fixed
  English corpus) followed by the 269 real LLaDA special tokens, {placement}
  {first}-{last}: `<|mdm_mask|>` = {mask}, `<|endoftext|>` = {eos}, `<|eot_id|>` = {eot}.
- Files: `config.json` (all 46 real keys; only sizes and ids changed), `generation_config.json`,
  `tokenizer.json`, `tokenizer_config.json` (real fields and chat template),
  `special_tokens_map.json`, `model.safetensors` (real LLaDA tensor names).
- Weights: norms ones, every other tensor `randn * 0.02` from `torch.Generator` seed {seed}.

Made with `python -m dllm_serve_train.tiny_checkpoints DIR`
(`dllm_serve_train.tiny_checkpoints.write_tiny_llada`); the same arguments always give
identical files.
"""


def write_tiny_llada(
    out_dir: str | Path,
    *,
    d_model: int = 64,
    n_layers: int = 2,
    n_heads: int = 4,
    mlp_hidden_size: int = 128,
    max_sequence_length: int = 2048,
    seed: int = 0,
    num_shards: int = 1,
    real_ids: bool = False,
) -> Path:
    """Write a complete LLaDA-format checkpoint to ``out_dir`` and return its path."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    out = Path(out_dir)
    make_dir(out)
    specials = llada_special_tokens()
    first = REAL_FIRST_ID if real_ids else base_vocab_size()
    tok = build_tokenizer(
        specials, {t: first + i for i, t in enumerate(specials)} if real_ids else None
    )
    # The specials must be one contiguous block, in real order.
    assert [tok.token_to_id(t) for t in specials] == list(range(first, first + len(specials)))
    # Round up to a multiple of 64, like LLaDA; the real size with real ids.
    vocab = REAL_VOCAB if real_ids else round_up(first + len(specials))
    bos, eos, mask, eot = (
        tok.token_to_id(t)
        for t in ("<|startoftext|>", "<|endoftext|>", "<|mdm_mask|>", "<|eot_id|>")
    )
    sizes = {"d_model": d_model, "n_heads": n_heads, "n_kv_heads": n_heads, "n_layers": n_layers,
             "mlp_hidden_size": mlp_hidden_size, "max_sequence_length": max_sequence_length,
             "vocab_size": vocab, "embedding_size": vocab}  # fmt: skip
    config = _real_config(sizes, {"mask_token_id": mask, "eos_token_id": eos, "pad_token_id": eos})
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {
        "_from_model_config": True, "bos_token_id": bos, "eos_token_id": eos,
        "transformers_version": "4.38.2",
    })  # fmt: skip
    _write_json(out / "special_tokens_map.json", _special_tokens_map())
    _write_json(out / "tokenizer_config.json", _tokenizer_config(specials, first))
    tok.save(str(out / "tokenizer.json"))
    readable(out / "tokenizer.json")

    tensors = random_weights(LLADA, LLADA.transformer_config(config), seed)
    save_weights(out, tensors, num_shards)
    write_text(out / "README.md", MODEL_CARD.format(
        d_model=d_model, n_layers=n_layers, n_heads=n_heads, mlp=mlp_hidden_size,
        max_len=max_sequence_length, params=sum(t.numel() for t in tensors.values()),
        vocab=vocab, merges=base_vocab_size() - 256, first=first, last=first + len(specials) - 1,
        mask=mask, eos=eos, eot=eot, seed=seed,
        placement="at their real ids" if real_ids else "moved as one block to ids",
    ))  # fmt: skip
    return out
