"""Prompt ids for a multi-turn chat equal what each checkpoint's own template renders."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dllm_serve.models.families import DREAM
from dllm_serve.models.loader import LoadedModel, load_model
from dllm_serve_train.tiny_checkpoints import write_tiny

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
REAL_TEMPLATE = {"llada": "llada-8b-instruct", "dream": "dream-v0-instruct-7b"}
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello there!"},
    {"role": "assistant", "content": "  Hi. "},
    {"role": "user", "content": "What is the capital of France?"},
]
EXPECTED_TEXT = {
    # LLaDA: BOS from the template, content trimmed, assistant header always appended.
    "llada": (
        "<|startoftext|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHello there!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHi.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is the capital of France?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    ),
    # Dream: Qwen2.5 ChatML, content verbatim.
    "dream": (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHello there!<|im_end|>\n"
        "<|im_start|>assistant\n  Hi. <|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    ),
}
EXPECTED_TEXT["idlm"] = EXPECTED_TEXT["dream"]  # plain ChatML


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoadedModel]:
    root = tmp_path_factory.mktemp("tiny")
    return {f: load_model(str(write_tiny(f, root / f))) for f in ("llada", "dream", "idlm")}


def render_real(family: str, messages: list[dict], **special: str) -> str:
    """Render the real checkpoint's template with jinja2 directly (as transformers does:
    sandboxed, trim_blocks, lstrip_blocks), independent of the tokenizer object."""
    tok_cfg = json.loads((FIXTURES / REAL_TEMPLATE[family] / "tokenizer_config.json").read_text())
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(tok_cfg["chat_template"])
    return template.render(messages=messages, add_generation_prompt=True, **special)


@pytest.mark.parametrize("family", ["llada", "dream", "idlm"])
def test_prompt_ids_equal_the_tokenizers_own_rendering(models, family: str) -> None:
    lm = models[family]
    ours = lm.chat_prompt_ids(MESSAGES)
    theirs = lm.tokenizer.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    theirs = theirs["input_ids"] if not isinstance(theirs, list) else theirs
    assert ours == list(theirs)
    assert lm.tokenizer.decode(ours, skip_special_tokens=False) == EXPECTED_TEXT[family]
    if family == "dream":  # Qwen2.5's template adds a default system prompt
        one = lm.chat_prompt_ids([{"role": "user", "content": "hi"}])
        assert lm.tokenizer.decode(one, skip_special_tokens=False).startswith(
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        )


# I-DLM's own template was not published with its metadata, so it has no "real" one here.
@pytest.mark.parametrize("family", list(REAL_TEMPLATE))
def test_prompt_ids_equal_the_real_template(models, family: str) -> None:
    lm = models[family]
    text = render_real(family, MESSAGES, bos_token=lm.tokenizer.bos_token)
    assert text == EXPECTED_TEXT[family]
    assert lm.chat_prompt_ids(MESSAGES) == lm.tokenizer.encode(text, add_special_tokens=False)
    # Special tokens are single ids, never spelled out byte by byte.
    ids = lm.chat_prompt_ids(MESSAGES)
    assert ids.count(lm.eot_id) == len(MESSAGES)


REAL_FORMATS = Path(
    os.environ.get(
        "DLLM_SERVE_REAL_FORMATS",
        Path(__file__).resolve().parents[4] / "shared" / "reference" / "formats",
    )
)


@pytest.mark.skipif(
    not (REAL_FORMATS / "Dream-v0-Instruct-7B" / "vocab.json").is_file(),
    reason="the real Dream vocab.json/merges.txt are not in this checkout (5 MB, kept outside)",
)
def test_real_dream_tokenizer_without_remote_code(tmp_path: Path) -> None:
    from dllm_serve.models.tokenization import load_tokenizer

    path = shutil.copytree(REAL_FORMATS / "Dream-v0-Instruct-7B", tmp_path / "dream")
    tok = load_tokenizer(path, DREAM)
    assert type(tok).__name__ == "Qwen2Tokenizer"
    assert tok.mask_token_id == 151666 and tok.eos_token_id == 151643
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [151644, 151645]
    text = render_real("dream", MESSAGES)
    ids = tok.encode(text, add_special_tokens=False)
    rendered = tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    assert ids == list(rendered["input_ids"])
    assert ids[:3] == [151644, 8948, 198]  # "<|im_start|>", "system", "\n" in Qwen2's vocabulary
    assert tok.decode(ids, skip_special_tokens=False) == text
