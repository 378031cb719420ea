"""Tiny random-weight checkpoints in the LLaDA-MoE-7B-A1B (``LLaDAMoEModelLM``) on-disk format.

``config.json`` carries the keys of the released LLaDA-MoE config (``model_type: "llada"``, the
MoE keys, ``moe_layer_freq``, ``qk_layernorm``, ``partial_rotary_factor``; reconstructed, see
``tests/fixtures/llada-moe-7b-a1b-instruct/README.md``) with small sizes; the weights use the
real tensor names: ``self_attn.{q,k,v,o}_proj``, ``self_attn.{q,k}_norm``, the router
``mlp.gate``, per-expert ``mlp.experts.{e}.*`` and, when asked for, dense ``mlp.*`` layers and
the decoder layer's ``shared_expert.*``. The tokenizer is the Ling one (``ling.py``) with its
real special-token strings and chat format. Output is a pure function of the arguments.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dllm_serve.models.families import LLADAMOE
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

A tiny **random-weight** checkpoint in the on-disk format of inclusionAI/LLaDA-MoE-7B-A1B
(`model_type: llada`, `LLaDAMoEModelLM`). Made by `dllm-serve make-tiny --family lladamoe` for
tests and demos; its answers are gibberish.

- Shape: hidden {d_model}, {n_layers} layers ({dense} dense, SwiGLU {mlp}; the others {experts}
  experts of width {expert}, softmax top-{top_k}{shared}), {n_heads} heads / {n_kv_heads} KV
  heads (head dim {head_dim}, RoPE on {rotary} dims), per-head q/k norm; {params:,} parameters,
  bf16.
- Vocabulary: {vocab} rows; byte-level BPE then {specials} at ids {first}-{last}
  (mask `<|mask|>` = {mask}, eos `<|endoftext|>` = {eos}).
- Weights: norms ones, everything else `randn * 0.02` from `torch.Generator` seed {seed}.
"""


def real_config() -> dict[str, Any]:
    """LLaDA-MoE-7B-A1B-Instruct's config.json (keys in file order), as reconstructed."""
    return {
        "architectures": ["LLaDAMoEModelLM"], "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {
            "AutoConfig": "configuration_lladamoe.LLaDAConfig",
            "AutoModel": "modeling_lladamoe.LLaDAMoEModelLM",
            "AutoModelForCausalLM": "modeling_lladamoe.LLaDAMoEModelLM",
        },
        "clip_qkv": None, "dense_intermediate_size": 8192, "eos_token_id": 156892,
        "expert_intermediate_size": 1024, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "max_position_embeddings": 8192, "model_type": "llada",
        "moe_layer_freq": [1] * 16, "moe_router_enable_expert_bias": False,
        "moe_router_score_function": "softmax", "norm_topk_prob": False,
        "num_attention_heads": 16, "num_experts": 64, "num_experts_per_tok": 8,
        "num_hidden_layers": 16, "num_key_value_heads": 16, "output_router_logits": False,
        "pad_token_id": 156892, "partial_rotary_factor": 1.0, "qk_layernorm": True,
        "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 50000,
        "routed_scaling_factor": 1, "router_aux_loss_coef": 0.01, "router_num_group": None,
        "router_topk_group": None, "shared_expert_intermediate_size": None,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.52.4", "use_cache": False, "vocab_size": 157184,
    }  # fmt: skip


def write_tiny_lladamoe(
    out_dir: str | Path,
    *,
    d_model: int = 64,
    n_layers: int = 2,
    n_heads: int = 4,
    n_kv_heads: int = 4,
    num_experts: int = 8,
    experts_per_token: int = 2,
    expert_hidden_size: int = 32,
    dense_layers: int = 0,
    dense_hidden_size: int = 128,
    shared_expert_hidden_size: int = 0,
    rotary_dim: int = 0,
    max_sequence_length: int = 2048,
    seed: int = 0,
    num_shards: int = 1,
) -> Path:
    """Write a complete LLaDA-MoE-format checkpoint and return its path.

    Like the released model every layer is MoE with no shared expert and RoPE on every head
    dim; ``dense_layers`` makes the first layers dense (``moe_layer_freq`` 0),
    ``shared_expert_hidden_size`` adds a shared expert, ``rotary_dim`` (0 = the head dim)
    sets ``partial_rotary_factor``.
    """
    if not 0 <= dense_layers <= n_layers:
        raise ValueError(f"dense_layers must be in [0, n_layers {n_layers}], got {dense_layers}")
    out = Path(out_dir)
    make_dir(out)
    tok, ids = ling_tokenizer()
    first = ids[SPECIALS[0]]
    vocab = round_up(first + len(SPECIALS))
    eos, mask = ids["<|endoftext|>"], ids["<|mask|>"]
    head_dim = d_model // n_heads
    config = real_config()
    config.update(
        dense_intermediate_size=dense_hidden_size, eos_token_id=eos,
        expert_intermediate_size=expert_hidden_size, hidden_size=d_model,
        max_position_embeddings=max_sequence_length,
        moe_layer_freq=[0] * dense_layers + [1] * (n_layers - dense_layers),
        num_attention_heads=n_heads, num_experts=num_experts,
        num_experts_per_tok=experts_per_token, num_hidden_layers=n_layers,
        num_key_value_heads=n_kv_heads, pad_token_id=eos,
        partial_rotary_factor=rotary_dim / head_dim if rotary_dim else 1.0,
        shared_expert_intermediate_size=shared_expert_hidden_size or None, vocab_size=vocab,
    )  # fmt: skip
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {
        "_from_model_config": True, "eos_token_id": eos, "pad_token_id": eos,
        "transformers_version": "4.52.4",
    })  # fmt: skip
    _write_json(out / "tokenizer_config.json", tokenizer_config(max_sequence_length))
    _write_json(out / "special_tokens_map.json", special_tokens_map())
    tok.save(str(out / "tokenizer.json"))
    readable(out / "tokenizer.json")

    tcfg = LLADAMOE.transformer_config(config)
    tensors = random_weights(LLADAMOE, tcfg, seed)
    save_weights(out, tensors, num_shards)
    _write_text(out / "README.md", CARD.format(
        name=out.name, d_model=d_model, n_layers=n_layers, dense=dense_layers,
        mlp=dense_hidden_size, experts=num_experts, expert=expert_hidden_size,
        top_k=experts_per_token,
        shared=f", shared expert {shared_expert_hidden_size}" if shared_expert_hidden_size else "",
        n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, rotary=tcfg.rotary_dim,
        params=sum(t.numel() for t in tensors.values()), vocab=vocab,
        specials=", ".join(f"`{t}`" for t in SPECIALS), first=first,
        last=first + len(SPECIALS) - 1, mask=mask, eos=eos, seed=seed,
    ))  # fmt: skip
    return out
