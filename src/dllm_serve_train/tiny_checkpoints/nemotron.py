"""Tiny random-weight checkpoints in the Nemotron-Labs-Diffusion on-disk format, and a tiny
draft LoRA in PEFT's format.

``config.json`` is the real 8B one (``formats/nemotron-labs-diffusion-8b/``) with only
sizes changed; the special ids stay real (BOS 1, EOS 11, mask 100) because the tokenizer keeps
a Ministral3-style control-token block at the lowest ids. YaRN keeps the real ratio of
``max_position_embeddings`` to ``original_max_position_embeddings`` (16), so a tiny model's
long positions exercise both YaRN and the Llama-4 query scaling. The tokenizer files, chat
template and generation config were not reachable and are reconstructed (see
``tests/fixtures/nemotron-labs-diffusion-8b/README.md``).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from dllm_serve.models.families import NEMOTRON
from dllm_serve.models.transformer import TransformerConfig
from dllm_serve_train.tiny_checkpoints.bpe import learn_bpe
from dllm_serve_train.tiny_checkpoints.files import FLAGS as _FLAGS
from dllm_serve_train.tiny_checkpoints.files import (
    make_dir,
    random_weights,
    readable,
    real_file,
    round_up,
    save_weights,
    write_json,
    write_text,
)

FORMAT = "nemotron-labs-diffusion-8b"
CONTROL = 128  # ids 0..127: the control-token block; the byte-level BPE follows
_NAMED = {0: "<unk>", 1: "<s>", 2: "</s>", 3: "[INST]", 4: "[/INST]",
          17: "[SYSTEM_PROMPT]", 18: "[/SYSTEM_PROMPT]"}  # fmt: skip
# Reconstructed (the real template was not reachable): Mistral's [INST] format.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{{ message['content'] }}[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[INST]{{ message['content'] }}[/INST]"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}"
    "{% endif %}{% endfor %}"
)
LORA_PREFIX = "base_model.model.encoder.layers"  # PeftModel over NemotronLabsDiffusionModel

CARD = """\
# {name}

A tiny **random-weight** checkpoint in the on-disk format of nvidia/Nemotron-Labs-Diffusion-8B
(tri-mode: `ar`, `diffusion`, `linear_spec`). Made by `dllm-serve make-tiny --family nemotron`
for tests and demos; its answers are gibberish.

- Shape: hidden {d_model}, {n_layers} layers, {n_heads} heads / {n_kv_heads} KV heads (head dim
  {head_dim}), SwiGLU MLP {mlp}; YaRN RoPE (factor {factor:g} over an original context of
  {original}) with Llama-4 query scaling, max_position_embeddings {max_len}; block {block};
  {params:,} parameters, bf16, tensors under the real `encoder.*` / `diffusion_head` names.
- Vocabulary: {vocab} rows: a control-token block at ids 0-{last_control} (BOS 1, EOS 11,
  mask 100 as in the real config), then the shared byte-level BPE.
- `config.json` is the real one with sizes changed. The tokenizer files, chat template and
  generation config are reconstructed (the real ones were not reachable).
- Weights: norms ones, everything else `randn * 0.02` from `torch.Generator` seed {seed}.
"""

LORA_CARD = """\
# {name}

A tiny **random** draft LoRA for `{base}` in PEFT's format (`adapter_config.json` +
`adapter_model.safetensors`): rank {rank}, alpha {alpha}, on every layer's `self_attn.o_proj`,
as Nemotron-Labs-Diffusion's bundled `linear_spec_lora`. `lora_A` and `lora_B` are
`randn * 0.1` from seed {seed} (non-zero, so the adapter changes the drafts). Serve it with
`dllm-serve --model {base_dir} --draft-lora {name_dir}`.
"""


def control_tokens() -> list[str]:
    """The control-token block, in id order (unknown real names are ``<SPECIAL_n>``)."""
    return [_NAMED.get(i, f"<SPECIAL_{i}>") for i in range(CONTROL)]


def build_tokenizer() -> Tokenizer:
    """Byte-level BPE after a :data:`CONTROL`-token block of special tokens at ids 0..127."""
    merges, items = learn_bpe()
    controls = control_tokens()
    vocab = {symbol: CONTROL + i for symbol, i in items}
    vocab.update({t: i for i, t in enumerate(controls)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in controls])
    return tok


def _config(sizes: dict[str, Any], original: int, vocab: int, block_size: int) -> dict[str, Any]:
    config = copy.deepcopy(real_file(FORMAT, "config.json"))
    rope = config["rope_parameters"]
    ratio = config["max_position_embeddings"] // rope["original_max_position_embeddings"]
    rope["original_max_position_embeddings"] = original
    rope["factor"] = float(ratio)
    config.update(sizes, vocab_size=vocab, block_size=block_size,
                  max_position_embeddings=original * ratio)  # fmt: skip
    return config


def _tokenizer_files(out: Path, tok: Tokenizer, config: dict[str, Any]) -> None:
    names = control_tokens()
    bos, eos = names[config["bos_token_id"]], names[config["eos_token_id"]]
    added = {str(i): {"content": t, **_FLAGS, "special": True} for i, t in enumerate(names)}
    write_json(out / "tokenizer_config.json", {
        "add_bos_token": True, "add_eos_token": False, "added_tokens_decoder": added,
        "bos_token": bos, "clean_up_tokenization_spaces": False, "eos_token": eos,
        "model_max_length": config["max_position_embeddings"], "pad_token": "<unk>",
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>",
    })  # fmt: skip
    write_json(out / "special_tokens_map.json", {
        "bos_token": {"content": bos, **_FLAGS}, "eos_token": {"content": eos, **_FLAGS},
        "pad_token": {"content": "<unk>", **_FLAGS}, "unk_token": {"content": "<unk>", **_FLAGS},
    })  # fmt: skip
    write_text(out / "chat_template.jinja", CHAT_TEMPLATE)
    tok.save(str(out / "tokenizer.json"))
    readable(out / "tokenizer.json")


def write_tiny_nemotron(
    out_dir: str | Path,
    *,
    d_model: int = 64,
    n_layers: int = 2,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    head_dim: int = 16,
    mlp_hidden_size: int = 128,
    rope_original_context: int = 128,
    block_size: int = 32,
    seed: int = 0,
    num_shards: int = 1,
    draft_lora_out: str | None = None,
    draft_lora_rank: int = 8,
) -> Path:
    """Write a Nemotron-Labs-Diffusion-format checkpoint (and, with ``draft_lora_out``, a tiny
    PEFT draft LoRA for it). ``max_position_embeddings`` is 16 × ``rope_original_context``."""
    out = Path(out_dir)
    make_dir(out)
    tok = build_tokenizer()
    vocab = round_up(tok.get_vocab_size())
    sizes = {
        "hidden_size": d_model, "intermediate_size": mlp_hidden_size, "head_dim": head_dim,
        "num_hidden_layers": n_layers, "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
    }  # fmt: skip
    config = _config(sizes, rope_original_context, vocab, block_size)
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json", {
        "_from_model_config": True, "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"], "transformers_version": "5.0.0",
        "use_cache": False,
    })  # fmt: skip
    _tokenizer_files(out, tok, config)
    tcfg = NEMOTRON.transformer_config(config)
    tensors = random_weights(NEMOTRON, tcfg, seed)
    save_weights(out, tensors, num_shards)
    rope = config["rope_parameters"]
    write_text(out / "README.md", CARD.format(
        name=out.name, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=n_kv_heads, head_dim=tcfg.head_dim, mlp=mlp_hidden_size,
        factor=rope["factor"], original=rope_original_context,
        max_len=config["max_position_embeddings"], block=block_size,
        params=sum(t.numel() for t in tensors.values()), vocab=vocab,
        last_control=CONTROL - 1, seed=seed,
    ))  # fmt: skip
    if draft_lora_out is not None:
        write_tiny_draft_lora(draft_lora_out, out, tcfg, rank=draft_lora_rank, seed=seed + 1)
    return out


def write_tiny_draft_lora(
    out_dir: str | Path, base: Path, tcfg: TransformerConfig, *, rank: int = 8, seed: int = 1
) -> Path:
    """A PEFT LoRA on every layer's ``o_proj`` of a model shaped ``tcfg`` (alpha = 4 · rank,
    the bundled adapter's ratio 512 / 128)."""
    if rank < 1:
        raise ValueError(f"the LoRA rank must be >= 1, got {rank}")
    out = Path(out_dir)
    make_dir(out)
    adapter = copy.deepcopy(real_file(FORMAT, "adapter_config.json"))
    adapter.update(r=rank, lora_alpha=4 * rank, base_model_name_or_path=base.name)
    write_json(out / "adapter_config.json", adapter)
    gen = torch.Generator().manual_seed(seed)
    width = tcfg.n_heads * tcfg.head_dim
    tensors: dict[str, torch.Tensor] = {}
    for i in range(tcfg.n_layers):
        name = f"{LORA_PREFIX}.{i}.self_attn.o_proj"
        a = torch.randn(rank, width, generator=gen) * 0.1
        b = torch.randn(tcfg.d_model, rank, generator=gen) * 0.1
        tensors[f"{name}.lora_A.weight"] = a.to(torch.bfloat16).contiguous()
        tensors[f"{name}.lora_B.weight"] = b.to(torch.bfloat16).contiguous()
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    readable(out / "adapter_model.safetensors")
    write_text(out / "README.md", LORA_CARD.format(
        name=out.name, base=base.name, rank=rank, alpha=4 * rank, seed=seed,
        base_dir=base, name_dir=out,
    ))  # fmt: skip
    return out
