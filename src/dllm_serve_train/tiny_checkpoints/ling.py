"""The Ling tokenizer's files as LLaDA2.x and LLaDA-MoE ship them, for tiny checkpoints.

Both families use inclusionAI's Ling tokenizer (``PreTrainedTokenizerFast``): bos
``<|startoftext|>``, eos = pad ``<|endoftext|>`` (156892 in the real 157184-row vocabulary),
mask ``<|mask|>`` (156895), end of turn ``<|role_end|>`` (id never published). A tiny
checkpoint puts these four right after the shared small byte-level BPE, so their ids differ
from the real ones: the loader must read them from the files, as it does for real checkpoints.
The turn format every reference client uses is
``<role>SYSTEM</role>…<|role_end|><role>HUMAN</role>…<|role_end|><role>ASSISTANT</role>``.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer

from dllm_serve_train.tiny_checkpoints.bpe import base_vocab_size, build_tokenizer
from dllm_serve_train.tiny_checkpoints.files import FLAGS

SPECIALS = ("<|startoftext|>", "<|endoftext|>", "<|mask|>", "<|role_end|>")

# Each message is ``<role>ROLE</role>content<|role_end|>``; the generation prompt opens the
# assistant turn.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{%- set role = 'SYSTEM' -%}"
    "{%- elif message['role'] == 'user' -%}{%- set role = 'HUMAN' -%}"
    "{%- elif message['role'] == 'assistant' -%}{%- set role = 'ASSISTANT' -%}"
    "{%- else -%}{%- set role = message['role'] | upper -%}{%- endif -%}"
    "{{- '<role>' + role + '</role>' + message['content'] + '<|role_end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<role>ASSISTANT</role>' -}}{%- endif -%}"
)


def ling_tokenizer(extra: tuple[str, ...] = ()) -> tuple[Tokenizer, dict[str, int]]:
    """The byte-level BPE plus :data:`SPECIALS` (then ``extra`` specials: LLaDA2.2's edit
    tokens) right after it, and each special's id."""
    first = base_vocab_size()
    specials = SPECIALS + extra
    tok = build_tokenizer(specials)
    ids = {t: first + i for i, t in enumerate(specials)}
    assert all(tok.token_to_id(t) == i for t, i in ids.items())
    return tok, ids


def tokenizer_config(max_len: int, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """``tokenizer_config.json``: the specials (and ``extra`` ones) as added tokens, the chat
    template."""
    first = base_vocab_size()
    return {
        "add_bos_token": False, "add_eos_token": False,
        "added_tokens_decoder": {
            str(first + i): {"content": t, **FLAGS, "special": True}
            for i, t in enumerate(SPECIALS + extra)
        },
        "bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False, "model_max_length": max_len,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }  # fmt: skip


def special_tokens_map() -> dict[str, Any]:
    return {
        "bos_token": {"content": "<|startoftext|>", **FLAGS},
        "eos_token": {"content": "<|endoftext|>", **FLAGS},
        "pad_token": {"content": "<|endoftext|>", **FLAGS},
    }
