"""write_tiny_llada: real format field for field, deterministic, committed asset up to date."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file
from tokenizers import Tokenizer

from dllm_serve.models.loader import EMBEDDED_MODELS
from dllm_serve.models.tiny import main, write_tiny_llada

REAL = Path(__file__).resolve().parents[2] / "fixtures" / "llada-8b-instruct"
ASSET = Path(EMBEDDED_MODELS["tiny-llada"])
SAMPLES = [
    "hello",
    "What is the capital of France?",
    "  leading and trailing spaces  ",
    "tabs\tnew\nlines\r\nand\x00nul",
    "ünïcødé, 日本語, العربية, emoji 🙂👍🏽, combining é",
    "<|eot_id|> literal special text <|mdm_mask|>",
    "",
]


def read(path: Path, name: str) -> dict:
    return json.loads((path / name).read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llada(tmp_path_factory.mktemp("a"))


def test_config_has_all_real_keys_only_sizes_and_ids_changed(fresh: Path) -> None:
    real, tiny = read(REAL, "config.json"), read(fresh, "config.json")
    assert list(tiny) == list(real) and len(tiny) == 46
    changed = {k for k in real if real[k] != tiny[k]}
    assert changed == {
        "d_model", "n_heads", "n_kv_heads", "n_layers", "mlp_hidden_size", "max_sequence_length",
        "vocab_size", "embedding_size", "mask_token_id", "eos_token_id", "pad_token_id",
    }  # fmt: skip
    assert tiny["vocab_size"] == tiny["embedding_size"] and tiny["vocab_size"] % 64 == 0


def test_tokenizer_files_reproduce_real_ones(fresh: Path) -> None:
    real, tiny = read(REAL, "tokenizer_config.json"), read(fresh, "tokenizer_config.json")
    assert list(tiny) == list(real)
    assert {k: v for k, v in tiny.items() if k != "added_tokens_decoder"} == {
        k: v for k, v in real.items() if k != "added_tokens_decoder"
    }
    first = int(next(iter(tiny["added_tokens_decoder"])))
    moved = {str(first + int(k) - 126080): v for k, v in real["added_tokens_decoder"].items()}
    assert tiny["added_tokens_decoder"] == moved
    assert read(fresh, "special_tokens_map.json") == read(REAL, "special_tokens_map.json")
    gen_real, gen_tiny = read(REAL, "generation_config.json"), read(fresh, "generation_config.json")
    assert list(gen_tiny) == list(gen_real)
    assert gen_tiny["bos_token_id"] == first and gen_tiny["eos_token_id"] == first + 1


def test_special_ids_consistent_and_inside_vocab(fresh: Path) -> None:
    from transformers import AutoTokenizer, PreTrainedConfig

    config = read(fresh, "config.json")
    tok = AutoTokenizer.from_pretrained(str(fresh), config=PreTrainedConfig())
    assert tok.bos_token_id == read(fresh, "generation_config.json")["bos_token_id"]
    assert tok.eos_token_id == tok.pad_token_id == config["eos_token_id"] == config["pad_token_id"]
    assert tok.convert_tokens_to_ids("<|mdm_mask|>") == config["mask_token_id"]
    assert tok.mask_token_id is None  # as in the real tokenizer: the mask is not declared
    assert max(tok.get_vocab().values()) < config["vocab_size"]
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
    )
    assert text == (
        "<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nhello<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    for sample in SAMPLES:
        ids = tok.encode(sample, add_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=False) == sample


def test_tokenizer_is_byte_level_bpe_with_real_words(fresh: Path) -> None:
    tok = Tokenizer.from_file(str(fresh / "tokenizer.json"))
    spec = json.loads((fresh / "tokenizer.json").read_text(encoding="utf-8"))
    assert spec["model"]["type"] == "BPE" and len(spec["model"]["merges"]) >= 300
    assert spec["pre_tokenizer"]["type"] == "ByteLevel" and spec["decoder"]["type"] == "ByteLevel"
    assert sorted(spec["model"]["vocab"].values())[:256] == list(range(256))
    assert len(tok.encode(" hello").ids) == 1 and len(tok.encode(" capital").ids) == 1
    for sample in SAMPLES:
        assert tok.decode(tok.encode(sample).ids, skip_special_tokens=False) == sample


def test_weights_are_bf16_with_real_names(fresh: Path) -> None:
    tensors = load_file(fresh / "model.safetensors")
    assert len(tensors) == 2 * 9 + 3
    assert {str(t.dtype) for t in tensors.values()} == {"torch.bfloat16"}
    assert (tensors["model.transformer.ln_f.weight"] == 1).all()
    assert tensors["model.transformer.wte.weight"].float().std().item() == pytest.approx(
        0.02, rel=0.1
    )


def test_deterministic(fresh: Path, tmp_path: Path) -> None:
    again = write_tiny_llada(tmp_path / "b")
    a, b = load_file(fresh / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    ta = Tokenizer.from_file(str(fresh / "tokenizer.json"))
    tb = Tokenizer.from_file(str(again / "tokenizer.json"))
    assert [ta.encode(s).ids for s in SAMPLES] == [tb.encode(s).ids for s in SAMPLES]
    other = load_file(write_tiny_llada(tmp_path / "c", seed=1) / "model.safetensors")
    assert not other["model.transformer.wte.weight"].equal(a["model.transformer.wte.weight"])


def test_committed_asset_is_up_to_date(fresh: Path) -> None:
    committed, current = (
        load_file(ASSET / "model.safetensors"),
        load_file(fresh / "model.safetensors"),
    )
    assert committed.keys() == current.keys()
    assert all(committed[k].equal(current[k]) for k in committed)
    for name in ("config.json", "generation_config.json", "tokenizer_config.json",
                 "special_tokens_map.json"):  # fmt: skip
        assert read(ASSET, name) == read(fresh, name), name
    ta = Tokenizer.from_file(str(ASSET / "tokenizer.json"))
    tb = Tokenizer.from_file(str(fresh / "tokenizer.json"))
    assert [ta.encode(s).ids for s in SAMPLES] == [tb.encode(s).ids for s in SAMPLES]
    assert (ASSET / "README.md").is_file()


def test_cli_writes_sharded_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main([str(tmp_path / "cli"), "--num-shards", "3", "--d-model", "32"]) == 0
    out = Path(capsys.readouterr().out.strip())
    index = read(out, "model.safetensors.index.json")
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    total = sum(t.numel() * t.element_size()
                for f in files for t in load_file(out / f).values())  # fmt: skip
    assert index["metadata"]["total_size"] == total
    assert read(out, "config.json")["d_model"] == 32
