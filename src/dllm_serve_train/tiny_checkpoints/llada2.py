"""Tiny random-weight checkpoints in the LLaDA2.x (``llada2_moe``) on-disk format.

``config.json`` carries the keys of the released LLaDA2.0-mini config (as recorded from
dFactory's model configs and xLLM's LLaDA2.1-mini fixture, reference ``block_diffusion.md``
§2.1) with small sizes; the weights use the real tensor names: fused
``attention.query_key_value``, q/k layernorms, a dense first layer, then per-expert
``mlp.experts.{e}.*`` tensors, the router ``mlp.gate.weight`` / ``mlp.gate.expert_bias`` and
``mlp.shared_experts.*``. The tokenizer is the shared small byte-level BPE plus LLaDA2's
special tokens right after it (``ling.py``: the real ids — mask 156895, eos 156892 — need the
real 157184-row vocabulary; the other specials' ids were never published), with the
``<role>HUMAN</role>…<|role_end|><role>ASSISTANT</role>`` chat format. Output is a pure
function of the arguments.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dllm_serve.models.families import LLADA2
from dllm_serve.models.families.llada2 import DEFAULT_BLOCK
from dllm_serve_train.tiny_checkpoints.files import (
    make_dir,
    random_weights,
    readable,
    round_up,
    save_weights,
)
from dllm_serve_train.tiny_checkpoints.files import write_json as _write_json
from dllm_serve_train.tiny_checkpoints.files import write_text as _write_text
from dllm_serve_train.tiny_checkpoints.ling import (
    SPECIALS,
    ling_tokenizer,
    special_tokens_map,
    tokenizer_config,
)

CARD = """\
# {name}

A tiny **random-weight** checkpoint in the on-disk format of inclusionAI/LLaDA2.0-mini
(`model_type: llada2_moe`). Made by `dllm-serve make-tiny --family llada2` for tests and
demos; its answers are gibberish.

- Shape: hidden {d_model}, {n_layers} layers (the first {dense} dense, SwiGLU {mlp}; the rest
  {experts} experts of width {expert}, top-{top_k} within the best {topk_group} of {n_group}
  groups, {shared} shared expert), {n_heads} heads / {n_kv_heads} KV heads (head dim
  {head_dim}, RoPE on the first {rotary} dims), q/k norm; {params:,} parameters, bf16.
- Vocabulary: {vocab} rows; byte-level BPE then {specials} at ids {first}-{last}
  (mask `<|mask|>` = {mask}, eos `<|endoftext|>` = {eos}).
- Blocks: {block} tokens{block_note}.
- Weights: norms ones, everything else `randn * 0.02` from `torch.Generator` seed
  {seed}.{editing_note}
"""

EDITING_NOTE = """
- Decoding: LLaDA2.1-style token editing by default (`generation_config.json`
  `decoding_algorithm: s_mode`: `confidence_threshold` 0.5 with `edit_threshold` 0.0 for
  requests that choose no commit rule). LLaDA2.1 has LLaDA2.0's format; this key is the
  server's, so an editing checkpoint can carry its preset."""


LEVENSHTEIN_NOTE = """
- LLaDA2.2-style (`config.json` `delete_token_id` {delete}, `split_token_id` {split},
  `expert_capacity` {capacity}, `block_size` {block}): insert/delete decoding
  (JointThresholdInDel) with the edit tokens `<|delete|>` and `<|split|>` (the real
  checkpoint's token strings were not published; its ids are 156930 and 156931), and block
  routing: each block of {block} positions uses at most {capacity} of the {experts} experts.
  `generation_config.json` `decoding_algorithm: s_mode` (τ 0.5, τ_edit 0.0, LLaDA2.2's
  recommended preset). A random model was not trained to edit: the edit tokens appear only
  where its random logits happen to favour them."""

# LLaDA2.2's edit tokens in the tiny vocabulary (after the shared specials).
EDIT_TOKENS = ("<|delete|>", "<|split|>")


def _config(sizes: dict[str, Any], eos: int, vocab: int) -> dict[str, Any]:
    """LLaDA2.0-mini's config.json keys with ``sizes`` and the tiny ids."""
    cfg: dict[str, Any] = {
        "architectures": ["LLaDA2MoeModelLM"],
        "auto_map": {
            "AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
            "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
            "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM",
        },
        "model_type": "llada2_moe",
        "hidden_size": 2048, "intermediate_size": 5120, "num_hidden_layers": 20,
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128,
        "first_k_dense_replace": 1, "num_experts": 256, "num_experts_per_tok": 8,
        "num_shared_experts": 1, "moe_intermediate_size": 512, "score_function": "sigmoid",
        "moe_router_enable_expert_bias": True, "n_group": 8, "topk_group": 4,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "router_dtype": "fp32",
        "rope_theta": 600000, "partial_rotary_factor": 0.5, "rotary_dim": 64,
        "rope_scaling": None, "use_qk_norm": True, "use_qkv_bias": False, "use_bias": False,
        "norm_head": False, "hidden_act": "silu", "rms_norm_eps": 1e-06,
        "max_position_embeddings": 32768, "vocab_size": 157184, "pad_token_id": 156892,
        "eos_token_id": 156892, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }  # fmt: skip
    cfg.update(sizes, vocab_size=vocab, pad_token_id=eos, eos_token_id=eos)
    return cfg


def write_tiny_llada2(
    out_dir: str | Path,
    *,
    block_size: int = DEFAULT_BLOCK,
    d_model: int = 64,
    n_layers: int = 3,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    head_dim: int = 16,
    mlp_hidden_size: int = 128,
    num_experts: int = 8,
    experts_per_token: int = 2,
    n_group: int = 2,
    topk_group: int = 1,
    expert_hidden_size: int = 32,
    max_sequence_length: int = 2048,
    seed: int = 0,
    num_shards: int = 1,
    editing: bool = False,
    levenshtein: bool = False,
) -> Path:
    """Write a complete LLaDA2-format (``llada2_moe``) checkpoint and return its path.

    ``editing``: a LLaDA2.1-style checkpoint that decodes by token editing by default
    (``generation_config.json`` ``decoding_algorithm: s_mode``).

    ``levenshtein``: a LLaDA2.2-style checkpoint: ``delete_token_id`` / ``split_token_id``
    (two more specials), ``expert_capacity`` (half the experts, at least ``experts_per_token``)
    and ``block_size`` in config.json, and the ``s_mode`` preset, which then decodes by
    JointThresholdInDel.

    ``block_size`` other than the default 32 is written as ``generation_config.json``'s
    ``block_length`` (where the loader reads a checkpoint's block when config.json has no
    ``block_size``); the released configs state none.
    """
    out = Path(out_dir)
    make_dir(out)
    extra = EDIT_TOKENS if levenshtein else ()
    tok, ids = ling_tokenizer(extra)
    first = ids[SPECIALS[0]]
    vocab = round_up(first + len(SPECIALS) + len(extra))
    bos, eos, mask = ids["<|startoftext|>"], ids["<|endoftext|>"], ids["<|mask|>"]
    sizes = {
        "hidden_size": d_model, "intermediate_size": mlp_hidden_size,
        "num_hidden_layers": n_layers, "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads, "head_dim": head_dim,
        "rotary_dim": head_dim // 2, "num_experts": num_experts,
        "num_experts_per_tok": experts_per_token, "n_group": n_group, "topk_group": topk_group,
        "moe_intermediate_size": expert_hidden_size, "max_position_embeddings": max_sequence_length,
    }  # fmt: skip
    config = _config(sizes, eos, vocab)
    capacity = max(experts_per_token, num_experts // 2)
    if levenshtein:
        config.update(
            delete_token_id=ids[EDIT_TOKENS[0]], split_token_id=ids[EDIT_TOKENS[1]],
            expert_capacity=capacity, block_size=block_size,
        )  # fmt: skip
    _write_json(out / "config.json", config)
    gen: dict[str, Any] = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": eos}
    if block_size != DEFAULT_BLOCK and not levenshtein:
        gen["block_length"] = block_size
    if editing or levenshtein:
        gen["decoding_algorithm"] = "s_mode"
    _write_json(out / "generation_config.json", gen)
    _write_json(out / "tokenizer_config.json", tokenizer_config(max_sequence_length, extra))
    _write_json(out / "special_tokens_map.json", special_tokens_map())
    tok.save(str(out / "tokenizer.json"))
    readable(out / "tokenizer.json")

    tcfg = LLADA2.transformer_config(config)
    assert tcfg.moe is not None
    tensors = random_weights(LLADA2, tcfg, seed)
    save_weights(out, tensors, num_shards)
    _write_text(out / "README.md", CARD.format(
        name=out.name, d_model=d_model, n_layers=n_layers, dense=tcfg.moe.first_dense_layers,
        mlp=mlp_hidden_size, experts=num_experts, expert=expert_hidden_size,
        top_k=experts_per_token, topk_group=topk_group, n_group=n_group,
        shared=config["num_shared_experts"], n_heads=n_heads, n_kv_heads=n_kv_heads,
        head_dim=head_dim, rotary=tcfg.rotary_dim,
        params=sum(t.numel() for t in tensors.values()), vocab=vocab,
        specials=", ".join(f"`{t}`" for t in SPECIALS), first=first,
        last=first + len(SPECIALS) - 1, mask=mask, eos=eos, block=block_size,
        block_note=" (config.json block_size)" if levenshtein
        else "" if block_size == DEFAULT_BLOCK else " (generation_config block_length)",
        seed=seed, editing_note=LEVENSHTEIN_NOTE.format(
            delete=config.get("delete_token_id"), split=config.get("split_token_id"),
            capacity=capacity, block=block_size, experts=num_experts,
        ) if levenshtein else EDITING_NOTE if editing else "",
    ))  # fmt: skip
    return out
