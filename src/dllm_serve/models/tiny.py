"""Write tiny random-weight checkpoints in the exact LLaDA-8B-Instruct on-disk format.

The vocabulary is small (a byte-level BPE trained on the fixed corpus below) but carries all
269 real LLaDA special tokens, moved as one contiguous block to just after the base vocabulary;
every id in the JSON files is moved consistently. Everything else (the 46 config keys, the
tokenizer config, the chat template) is reproduced field for field, so the loader is exercised
on the real format. Output is a pure function of the arguments.

Usage: ``python -m dllm_serve.models.tiny DIR [--d-model 64 ...]``.
"""

from __future__ import annotations

import argparse
import inspect
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from dllm_serve.models.families import LLADA
from dllm_serve.models.transformer import DecoderTransformer

N_MERGES = 499  # 256 bytes + 499 merges + 269 specials = 1024 rows, a multiple of 64


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

# The BPE merges are learned from this text. It is fixed so the tokenizer is reproducible; it
# is ordinary chat-flavoured English so that common words become single tokens.
CORPUS = """\
Hello! How are you today? I am fine, thank you. What can I do for you?
Hello, hello, hello. Hi there. Good morning, good afternoon and good evening.
You are a helpful assistant. The user asks a question and the assistant gives an answer.
Please answer the question in one short sentence. Explain your reasoning step by step.
What is the capital of France? The capital of France is Paris.
What is the capital of Germany? The capital of Germany is Berlin.
What is two plus two? Two plus two is four. What is three times three? It is nine.
The quick brown fox jumps over the lazy dog. The dog was not amused by the fox.
Write a short poem about the sea. The sea is wide and the waves are blue and white.
Can you help me write a story? Once upon a time there was a little cat who lived in a house.
The cat liked to sleep in the sun and to play with the children of the family every day.
Tell me a joke. Why did the chicken cross the road? To get to the other side.
Thank you very much for your help. You are welcome; I am happy to help with anything.
Diffusion language models generate text by filling in masked tokens over many steps.
The model looks at the whole sequence at once and predicts every masked position in parallel.
At each step the most confident predictions are kept and the others are masked again.
This server streams the answer to the client as soon as the text at the start is final.
Python is a programming language. Here is a function that returns the sum of two numbers.
def add(a, b): return a + b. The function takes two arguments and returns their sum.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 2024. Dates: Monday, Tuesday, Friday.
The weather is nice today. It is sunny and warm, but it may rain later in the evening.
I think that this is a good idea. Do you think so too? Yes, I do. No, I do not.
Summarize the following text in three sentences. The main point of the text is simple.
Translate this sentence into French: I like to read books. J'aime lire des livres.
Where is the nearest train station? It is about five minutes from here on foot.
Learning takes time and practice. Read the question carefully before you answer it.
The history of science is the study of how people came to understand the natural world.
Water boils at one hundred degrees and freezes at zero degrees on the Celsius scale.
Sorry, I do not know the answer to that question. Could you give me more information?
Let us think about this problem together and find a solution that works for everyone.
The first step is to understand the problem. The second step is to make a plan.
Here are some ideas: go for a walk, read a book, cook a meal or call a friend.
Because the model is small and random, its answers will be gibberish, not good advice.
hello
hello world, hello again. hello, who are you?
what is the answer? what do you mean? what time is it?
how do I cook rice? how are you? the end. the answer is yes. thanks!
"""


def byte_symbols() -> list[str]:
    """The 256 byte-level symbols in byte order (the GPT-2 byte-to-unicode table).

    Printable Latin-1 bytes stand for themselves; the rest are shifted to U+0100 onwards so
    that every byte has a visible, non-whitespace symbol.
    """
    direct = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
              *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
    shifted = iter(range(256, 512))
    return [chr(b) if b in direct else chr(next(shifted)) for b in range(256)]


def build_tokenizer() -> Tokenizer:
    """Byte-level BPE: bytes at ids 0-255, learned merges next, then the LLaDA specials."""
    symbols = byte_symbols()
    assert set(symbols) == set(pre_tokenizers.ByteLevel.alphabet())
    trainer = trainers.BpeTrainer(
        vocab_size=256 + N_MERGES, min_frequency=1, show_progress=False,
        initial_alphabet=symbols, special_tokens=[],
    )  # fmt: skip
    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    learner.train_from_iterator(CORPUS.splitlines(), trainer)
    merges = [tuple(m) for m in json.loads(learner.to_str())["model"]["merges"]]
    # Re-number: the trainer orders its alphabet by code point; we want byte order, then each
    # merged token at its first appearance (two merges can produce the same string).
    vocab = {s: i for i, s in enumerate(symbols)}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in llada_special_tokens()]
    )
    return tok


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
_FLAGS = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}


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


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """bf16 tensors under LLaDA's names: norms are ones, everything else randn * 0.02."""
    tcfg = LLADA.transformer_config(config)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in DecoderTransformer(tcfg).state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    # Draw in the family's fixed name order so the same seed always gives the same tensors.
    for theirs, ours in LLADA.weight_map(tcfg).items():
        shape = shapes[ours]
        if theirs.endswith("norm.weight") or theirs.endswith("ln_f.weight"):
            t = torch.ones(shape)
        else:
            t = torch.randn(shape, generator=gen) * 0.02
        out[theirs] = t.to(torch.bfloat16).contiguous()
    return out


def _save_weights(out: Path, tensors: dict[str, torch.Tensor], num_shards: int) -> None:
    names = list(tensors)
    if num_shards == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    bounds = [round(i * len(names) / num_shards) for i in range(num_shards + 1)]
    weight_map: dict[str, str] = {}
    for i in range(num_shards):
        fname = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[bounds[i] : bounds[i + 1]]}
        save_file(part, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(out / "model.safetensors.index.json", index)


MODEL_CARD = """\
# tiny-llada

A tiny **random-weight** checkpoint in the exact on-disk format of GSAI-ML/LLaDA-8B-Instruct.
It exists so that dllm-serve runs, and its tests exercise the real loader, tokenizer and chat
template, with no download and no GPU. Its answers are gibberish: it was never trained.

- Shape: d_model {d_model}, {n_layers} layers, {n_heads} heads (MHA), SwiGLU MLP {mlp},
  RoPE theta 500000, untied LM head, max_sequence_length {max_len}; {params:,} parameters in bf16.
- Vocabulary: {vocab} rows. A byte-level BPE (256 bytes + {merges} merges learned from a fixed
  English corpus) followed by the 269 real LLaDA special tokens, moved as one block to ids
  {first}-{last}: `<|mdm_mask|>` = {mask}, `<|endoftext|>` = {eos}, `<|eot_id|>` = {eot}.
- Files: `config.json` (all 46 real keys; only sizes and ids changed), `generation_config.json`,
  `tokenizer.json`, `tokenizer_config.json` (real fields and chat template),
  `special_tokens_map.json`, `model.safetensors` (real LLaDA tensor names).
- Weights: norms ones, every other tensor `randn * 0.02` from `torch.Generator` seed {seed}.

Made with `python -m dllm_serve.models.tiny DIR` (`dllm_serve.models.tiny.write_tiny_llada`);
the same arguments always give identical files.
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
) -> Path:
    """Write a complete LLaDA-format checkpoint to ``out_dir`` and return its path."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    specials = llada_special_tokens()
    first = tok.token_to_id(specials[0])
    # The specials must be one contiguous block right after the base vocabulary, in real order.
    assert [tok.token_to_id(t) for t in specials] == list(range(first, first + len(specials)))
    vocab = -(-(first + len(specials)) // 64) * 64  # round up to a multiple of 64, like LLaDA
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

    tensors = _weights(config, seed)
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)  # never leave a mix of single-file and sharded weights
    _save_weights(out, tensors, num_shards)
    (out / "README.md").write_text(MODEL_CARD.format(
        d_model=d_model, n_layers=n_layers, n_heads=n_heads, mlp=mlp_hidden_size,
        max_len=max_sequence_length, params=sum(t.numel() for t in tensors.values()),
        vocab=vocab, merges=first - 256, first=first, last=first + len(specials) - 1,
        mask=mask, eos=eos, eot=eot, seed=seed,
    ), encoding="utf-8")  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    """Command line: ``python -m dllm_serve.models.tiny DIR [--d-model N ...]``."""
    p = argparse.ArgumentParser(prog="dllm-serve make-tiny", description=write_tiny_llada.__doc__)
    p.add_argument("out_dir", help="directory to write (created if missing)")
    options = inspect.signature(write_tiny_llada).parameters
    for name, param in options.items():
        if param.kind is inspect.Parameter.KEYWORD_ONLY:
            p.add_argument("--" + name.replace("_", "-"), type=int, default=param.default)
    args = vars(p.parse_args(argv))
    print(write_tiny_llada(args.pop("out_dir"), **args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
