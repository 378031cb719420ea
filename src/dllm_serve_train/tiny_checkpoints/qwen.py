"""Tiny random-weight checkpoints in the Qwen-based on-disk formats: Dream-v0-Instruct-7B,
I-DLM-8B, SDAR (I-DLM's files made block-causal) and Fast-dLLM v2 7B.

Config, generation config and tokenizer files are the real ones (``formats/``) with only
sizes changed and, for the default small vocabulary, every special id moved consistently to
just after the base vocabulary (``real_ids`` keeps the real ids and vocabulary size). The
tokenizer is Qwen2's file format, ``vocab.json`` + ``merges.txt``, built from the shared
byte-level BPE; weights use Qwen2 (Dream, Fast-dLLM v2: q/k/v biases) or Qwen3 (I-DLM, SDAR:
q/k norms) tensor names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dllm_serve.models.families import DREAM, FAST_DLLM, SDAR, SDAR_BLOCK, Family
from dllm_serve.models.families.fast_dllm import DEFAULT_BLOCK
from dllm_serve_train.tiny_checkpoints.bpe import base_vocab_size, qwen2_vocab_files
from dllm_serve_train.tiny_checkpoints.files import (
    make_dir,
    random_weights,
    real_file,
    round_up,
    save_weights,
    write_text,
)
from dllm_serve_train.tiny_checkpoints.files import write_json as _write_json

REAL_FIRST_ID = 151643  # <|endoftext|>, the first added token of Qwen2/Qwen3 tokenizers

CARD = """\
# {name}

A tiny **random-weight** checkpoint in the on-disk format of {real}. Made by
`dllm-serve make-tiny --family {family}` for tests and demos; its answers are gibberish.

- Shape: hidden {d_model}, {n_layers} layers, {n_heads} heads / {n_kv_heads} KV heads (head dim
  {head_dim}), SwiGLU MLP {mlp}, max_position_embeddings {max_len}; {params:,} parameters, bf16.
- Vocabulary: {vocab} rows; byte-level BPE then the real special tokens {placement} ids
  {first}-{last} (mask `{mask_token}` = {mask}).
- Config, generation config and tokenizer files: the real ones, only sizes and ids changed.
- Weights: norms ones, everything else `randn * 0.02` from `torch.Generator` seed {seed}.
"""


# family → make-tiny name
TINY_NAMES = {"dream": "dream", "sdar": "idlm", "sdar_block": "sdar", "fastdllm": "fastdllm"}


def _moved(real_id: Any, first: int) -> Any:
    """A real special id moved to the block starting at ``first`` (lists element-wise)."""
    if isinstance(real_id, list):
        return [_moved(i, first) for i in real_id]
    if isinstance(real_id, int) and real_id >= REAL_FIRST_ID:
        return first + real_id - REAL_FIRST_ID
    return real_id


def _write(
    out_dir: str | Path,
    family: Family,
    fmt: str,
    sizes: dict[str, Any],
    *,
    seed: int,
    num_shards: int,
    real_ids: bool,
) -> Path:
    out = Path(out_dir)
    make_dir(out)
    added: dict[str, int] = real_file(fmt, "added_tokens.json")
    first = REAL_FIRST_ID if real_ids else base_vocab_size()
    n_special = max(added.values()) - REAL_FIRST_ID + 1
    assert sorted(added.values()) == list(range(REAL_FIRST_ID, REAL_FIRST_ID + n_special))

    config = real_file(fmt, "config.json")
    vocab = config["vocab_size"] if real_ids else round_up(first + n_special)
    config.update(sizes, vocab_size=vocab)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "mask_token_id"):
        if key in config:
            config[key] = _moved(config[key], first)
    _write_json(out / "config.json", config)
    try:
        gen = real_file(fmt, "generation_config.json")
    except FileNotFoundError:
        gen = None  # I-DLM's was not published; the loader does without
    if gen is not None:
        for key in ("bos_token_id", "eos_token_id", "pad_token_id", "mask_token_id"):
            if key in gen:
                gen[key] = _moved(gen[key], first)
        _write_json(out / "generation_config.json", gen)

    tok_cfg = real_file(fmt, "tokenizer_config.json")
    tok_cfg["added_tokens_decoder"] = {
        str(_moved(int(k), first)): v for k, v in tok_cfg["added_tokens_decoder"].items()
    }
    _write_json(out / "tokenizer_config.json", tok_cfg)
    _write_json(out / "special_tokens_map.json", real_file(fmt, "special_tokens_map.json"))
    _write_json(out / "added_tokens.json", {t: _moved(i, first) for t, i in added.items()})
    if "chat_template" not in tok_cfg:  # transformers 5.x style: a separate file
        write_text(out / "chat_template.jinja", real_file(fmt, "chat_template.jinja"))
    vocab_json, merges_txt = qwen2_vocab_files(added if real_ids else None)
    write_text(out / "vocab.json", vocab_json)
    write_text(out / "merges.txt", merges_txt)

    tcfg = family.transformer_config(config)
    tensors = random_weights(family, tcfg, seed)
    save_weights(out, tensors, num_shards)
    write_text(out / "README.md", CARD.format(
        name=out.name, real=fmt, family=TINY_NAMES[family.name],
        d_model=tcfg.d_model, n_layers=tcfg.n_layers, n_heads=tcfg.n_heads,
        n_kv_heads=tcfg.n_kv_heads, head_dim=tcfg.head_dim, mlp=tcfg.mlp_hidden_size,
        max_len=tcfg.max_sequence_length, params=sum(t.numel() for t in tensors.values()),
        vocab=vocab, placement="at their real" if real_ids else "moved as one block to",
        first=first, last=first + n_special - 1, mask_token=family.mask_token,
        # Fast-dLLM v2's config has no mask_token_id: its mask id is the tokenizer's.
        mask=config.get("mask_token_id", _moved(added[family.mask_token], first)), seed=seed,
    ))  # fmt: skip
    return out


def write_tiny_dream(
    out_dir: str | Path,
    *,
    d_model: int = 64,
    n_layers: int = 2,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    mlp_hidden_size: int = 128,
    max_sequence_length: int = 2048,
    seed: int = 0,
    num_shards: int = 1,
    real_ids: bool = False,
) -> Path:
    """Write a complete Dream-format (Qwen2 weights, ``model_type: Dream``) checkpoint."""
    sizes = {
        "hidden_size": d_model, "intermediate_size": mlp_hidden_size,
        "num_hidden_layers": n_layers, "max_window_layers": n_layers,
        "num_attention_heads": n_heads, "num_key_value_heads": n_kv_heads,
        "max_position_embeddings": max_sequence_length,
    }  # fmt: skip
    return _write(out_dir, DREAM, "dream-v0-instruct-7b", sizes,
                  seed=seed, num_shards=num_shards, real_ids=real_ids)  # fmt: skip


def write_tiny_idlm(
    out_dir: str | Path,
    *,
    d_model: int = 64,
    n_layers: int = 2,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    head_dim: int = 16,
    mlp_hidden_size: int = 128,
    max_sequence_length: int = 2048,
    seed: int = 0,
    num_shards: int = 1,
    real_ids: bool = False,
) -> Path:
    """Write a complete I-DLM-format (SDAR config, Qwen3 weights) checkpoint."""
    sizes = _qwen3_sizes(
        d_model, n_layers, n_heads, n_kv_heads, head_dim, mlp_hidden_size, max_sequence_length
    )
    return _write(out_dir, SDAR, "idlm-8b", sizes,
                  seed=seed, num_shards=num_shards, real_ids=real_ids)  # fmt: skip


def write_tiny_sdar(
    out_dir: str | Path,
    *,
    block_size: int = 4,
    d_model: int = 64,
    n_layers: int = 2,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    head_dim: int = 16,
    mlp_hidden_size: int = 128,
    max_sequence_length: int = 2048,
    seed: int = 0,
    num_shards: int = 1,
    real_ids: bool = False,
) -> Path:
    """Write an SDAR/TraDo block-diffusion checkpoint: I-DLM's SDAR config and Qwen3 tensors
    with the keys that make it block-causal (``use_regular_causal: false``, ``block_size``)."""
    sizes = _qwen3_sizes(
        d_model, n_layers, n_heads, n_kv_heads, head_dim, mlp_hidden_size, max_sequence_length
    )
    sizes.update(use_regular_causal=False, block_size=block_size)
    return _write(out_dir, SDAR_BLOCK, "idlm-8b", sizes,
                  seed=seed, num_shards=num_shards, real_ids=real_ids)  # fmt: skip


def write_tiny_fastdllm(
    out_dir: str | Path,
    *,
    block_size: int = DEFAULT_BLOCK,
    d_model: int = 64,
    n_layers: int = 2,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    mlp_hidden_size: int = 128,
    max_sequence_length: int = 2048,
    seed: int = 0,
    num_shards: int = 1,
    real_ids: bool = False,
) -> Path:
    """Write a Fast-dLLM v2 checkpoint: the 7B's config (``Fast_dLLM_Qwen``, ``bd_size`` =
    ``block_size``, a multiple of its 8-token sub-block), tokenizer files with ``|<MASK>|``
    and the ChatML template, and Qwen2 tensors (q/k/v biases)."""
    sizes: dict[str, Any] = {
        "hidden_size": d_model, "intermediate_size": mlp_hidden_size,
        "num_hidden_layers": n_layers, "max_window_layers": n_layers,
        "num_attention_heads": n_heads, "num_key_value_heads": n_kv_heads,
        "max_position_embeddings": max_sequence_length, "bd_size": block_size,
        "layer_types": ["full_attention"] * n_layers,
    }  # fmt: skip
    return _write(out_dir, FAST_DLLM, "fast-dllm-v2-7b", sizes,
                  seed=seed, num_shards=num_shards, real_ids=real_ids)  # fmt: skip


def _qwen3_sizes(
    d_model: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    mlp: int,
    max_len: int,
) -> dict[str, int]:
    """The config.json sizes of a Qwen3-weights checkpoint (I-DLM, SDAR)."""
    return {
        "hidden_size": d_model, "intermediate_size": mlp, "head_dim": head_dim,
        "num_hidden_layers": n_layers, "max_window_layers": n_layers,
        "num_attention_heads": n_heads, "num_key_value_heads": n_kv_heads,
        "max_position_embeddings": max_len,
    }  # fmt: skip
