"""Tiny checkpoints: real formats field for field, deterministic, committed asset up to date."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import pytest
from safetensors.torch import load_file
from tokenizers import Tokenizer

from dllm_serve.models.loader import EMBEDDED_MODELS
from dllm_serve_train.tiny_checkpoints import main, write_tiny, write_tiny_llada

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


# ---- Dream and I-DLM formats, and real ids ---------------------------------------------------
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
SIZE_KEYS = {
    "hidden_size", "intermediate_size", "num_hidden_layers", "max_window_layers",
    "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "vocab_size",
}  # fmt: skip
ID_KEYS = {"bos_token_id", "eos_token_id", "pad_token_id", "mask_token_id"}
FORMATS = {"dream": ("dream-v0-instruct-7b", set()), "idlm": ("idlm-8b", {"head_dim"})}


@pytest.mark.parametrize("family", ["dream", "idlm"])
@pytest.mark.parametrize("real_ids", [False, True])
def test_qwen_formats_reproduce_real_files(family: str, real_ids: bool, tmp_path: Path) -> None:
    fixture, extra_sizes = FORMATS[family]
    real_dir = FIXTURES / fixture
    out = write_tiny(family, tmp_path / family, real_ids=real_ids)
    real, tiny = read(real_dir, "config.json"), read(out, "config.json")
    assert list(tiny) == list(real)
    changed = {k for k in real if real[k] != tiny[k]}
    assert changed <= SIZE_KEYS | extra_sizes | (set() if real_ids else ID_KEYS)
    first = 151643 if real_ids else tiny["bos_token_id"]
    assert tiny["mask_token_id"] - first == real["mask_token_id"] - 151643
    assert tiny["eos_token_id"] - first == real["eos_token_id"] - 151643
    # Tokenizer files: the real ones, ids moved by one offset.
    real_tc, tiny_tc = read(real_dir, "tokenizer_config.json"), read(out, "tokenizer_config.json")
    assert list(tiny_tc) == list(real_tc)
    assert {k: v for k, v in tiny_tc.items() if k != "added_tokens_decoder"} == {
        k: v for k, v in real_tc.items() if k != "added_tokens_decoder"
    }
    moved = {str(first + int(k) - 151643): v for k, v in real_tc["added_tokens_decoder"].items()}
    assert tiny_tc["added_tokens_decoder"] == moved
    assert read(out, "special_tokens_map.json") == read(real_dir, "special_tokens_map.json")
    real_added = read(real_dir, "added_tokens.json")
    assert read(out, "added_tokens.json") == {t: first + i - 151643 for t, i in real_added.items()}
    if (real_dir / "generation_config.json").is_file():
        gen_real, gen_tiny = (
            read(real_dir, "generation_config.json"),
            read(out, "generation_config.json"),
        )
        assert list(gen_tiny) == list(gen_real)
        assert gen_tiny["eos_token_id"] == first + gen_real["eos_token_id"] - 151643
    # Qwen2's tokenizer file format, no tokenizer.json (as in the real checkpoints).
    assert (out / "vocab.json").is_file() and (out / "merges.txt").is_file()
    assert not (out / "tokenizer.json").exists()
    assert (out / "merges.txt").read_text().startswith("#version: 0.2\n")
    assert max(read(out, "added_tokens.json").values()) < tiny["vocab_size"]


@pytest.mark.parametrize("family", ["llada", "dream", "idlm"])
def test_real_ids_load_with_real_ids(family: str, tmp_path: Path) -> None:
    from dllm_serve.models.loader import load_model

    loaded = load_model(str(write_tiny(family, tmp_path / family, real_ids=True, n_layers=1)))
    want = {"llada": (126336, 126081, 126348), "dream": (151666, 151643, 151645),
            "idlm": (151669, 151645, 151645)}[family]  # fmt: skip
    assert (loaded.mask_id, loaded.eos_id, loaded.eot_id) == want
    text = f"hi {loaded.family.mask_token}"
    assert loaded.tokenizer.encode(text, add_special_tokens=False)[-1] == want[0]


def test_llada_real_ids_config_is_the_real_one(tmp_path: Path) -> None:
    out = write_tiny_llada(tmp_path / "r", real_ids=True)
    real, tiny = read(REAL, "config.json"), read(out, "config.json")
    assert {k for k in real if real[k] != tiny[k]} == {
        "d_model", "n_heads", "n_kv_heads", "n_layers", "mlp_hidden_size", "max_sequence_length",
    }  # fmt: skip
    assert read(out, "tokenizer_config.json") == read(REAL, "tokenizer_config.json")


@pytest.mark.parametrize("family", ["dream", "idlm"])
def test_qwen_formats_deterministic(family: str, tmp_path: Path) -> None:
    a = load_file(write_tiny(family, tmp_path / "a") / "model.safetensors")
    b = load_file(write_tiny(family, tmp_path / "b") / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    assert (tmp_path / "a" / "vocab.json").read_bytes() == (
        tmp_path / "b" / "vocab.json"
    ).read_bytes()


def test_cli_family_flag(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert (
        main(["--family", "idlm", str(tmp_path / "i"), "--num-shards", "2", "--head-dim", "8"]) == 0
    )
    out = Path(capsys.readouterr().out.strip())
    assert read(out, "config.json")["model_type"] == "sdar"
    assert read(out, "config.json")["head_dim"] == 8
    assert (out / "model.safetensors.index.json").is_file()
    assert main([str(tmp_path / "d"), "--family", "dream", "--real-ids"]) == 0
    out = Path(capsys.readouterr().out.strip())
    assert read(out, "config.json")["mask_token_id"] == 151666
    with pytest.raises(SystemExit):
        main(["--family", "gpt2", str(tmp_path / "x")])
    with pytest.raises(ValueError, match="unknown family"):
        write_tiny("gpt2", tmp_path / "x")


def test_module_entry_point_defaults_to_llada(tmp_path: Path, monkeypatch, capsys) -> None:
    import runpy
    import sys

    monkeypatch.setattr(sys, "argv", ["tiny", str(tmp_path / "m"), "--n-layers", "1"])
    with pytest.raises(SystemExit) as e:
        runpy.run_module("dllm_serve_train.tiny_checkpoints", run_name="__main__")
    assert e.value.code == 0
    assert read(tmp_path / "m", "config.json")["model_type"] == "llada"


# ---- file modes and --help ---------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llada", "dream", "idlm"])
@pytest.mark.parametrize("num_shards", [1, 2])
def test_every_file_is_world_readable_whatever_the_umask(
    family: str, num_shards: int, tmp_path: Path
) -> None:
    """safetensors writes its files 0600; a server running as another user (the Docker image's
    UID 10001) could not read them. Every file comes out 0644, even under umask 077."""
    old = os.umask(0o077)
    try:
        out = write_tiny(family, tmp_path / family, n_layers=1, num_shards=num_shards)
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert sum(name.endswith(".safetensors") for name in modes) == num_shards
    assert modes == dict.fromkeys(modes, 0o644)
    # The directory too: a 0700 one (umask 077) would hide every file (found by QA).
    assert stat.S_IMODE(out.stat().st_mode) == 0o755


def help_text(capsys: pytest.CaptureFixture, *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize(
    ("family", "flags", "absent"),
    [
        ("llada", ["--n-heads"], ["--n-kv-heads", "--head-dim"]),
        ("dream", ["--n-kv-heads"], ["--head-dim"]),
        ("idlm", ["--n-kv-heads", "--head-dim"], []),
    ],
)
def test_help_describes_every_family_and_the_chosen_ones_flags(
    family: str, flags: list[str], absent: list[str], capsys: pytest.CaptureFixture
) -> None:
    text = help_text(capsys, "--family", family)
    assert text == help_text(capsys, "DIR", "--family", family)  # flag order does not matter
    assert "LLaDA-format" not in text
    assert "\n  llada  LLaDA-8B-Instruct: LLaDA config and tensor names, tokenizer.json\n" in text
    assert "\n  dream  Dream-v0-Instruct-7B: Dream config, Qwen2 tensors, vocab.json +" in text
    assert "\n  idlm   I-DLM-8B: SDAR config, Qwen3 tensors, vocab.json + merges.txt\n" in text
    prose = " ".join(text.split())
    assert f"The size flags below are those of --family {family};" in prose
    for other in {"llada", "dream", "idlm"} - {family}:
        assert f"`dllm-serve make-tiny --family {other} --help`" in prose
    assert "mode 0644" in prose
    for flag in flags:
        assert f" {flag} " in text, flag
    for flag in absent:
        assert flag not in text, flag
    assert help_text(capsys) == help_text(capsys, "--family", "llada")  # llada by default


def test_docs_synopsis_lists_only_real_flags(capsys: pytest.CaptureFixture) -> None:
    """docs/models.md's make-tiny synopsis: every flag exists, for the families it names."""
    doc = (Path(__file__).resolve().parents[3] / "docs" / "models.md").read_text()
    synopsis = doc.split("dllm-serve make-tiny [--family", 1)[1].split("```", 1)[0]
    names = ("llada", "dream", "idlm", "sdar", "llada2", "lladamoe", "fastdllm", "nemotron")
    helps = {f: help_text(capsys, "--family", f) for f in names}
    for flag in re.findall(r"\[(--[a-z-]+)", synopsis):
        assert any(f" {flag} " in text for text in helps.values()), flag
    for flag, families in (
        ("--n-kv-heads", {"dream", "idlm", "sdar", "llada2", "lladamoe", "fastdllm", "nemotron"}),
        ("--head-dim", {"idlm", "sdar", "llada2", "nemotron"}),
        ("--block-size", {"sdar", "llada2", "fastdllm", "nemotron"}),
        ("--draft-lora-rank", {"nemotron"}),
        ("--expert-hidden-size", {"llada2", "lladamoe"}),
        ("--topk-group", {"llada2"}),
        ("--rotary-dim", {"lladamoe"}),
    ):
        assert re.search(rf"\[{flag} \d+\]\s+\({', '.join(sorted(families))}\)", synopsis), flag
        assert {f for f, text in helps.items() if f" {flag} " in text} == families, flag


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--d-model", "65"], "d_model 65 is not divisible by n_heads 4"),
        (["--num-shards", "0"], "argument --num-shards: must be >= 1, got 0"),
        (["--num-shards", "1000"], "num_shards must be in [1, 21]"),
        (["--family", "fastdllm", "--block-size", "12"], "bd_size 12 is not a multiple"),
    ],
)
def test_make_tiny_refuses_sizes_that_do_not_fit_and_leaves_nothing(
    tmp_path: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Found by QA: a traceback and a half-written directory (config and tokenizer, no
    # weights), or 979 empty shard files the index never named.
    from dllm_serve_train.tiny_checkpoints import main

    out = tmp_path / "ckpt"
    with pytest.raises(SystemExit) as info:
        main([*argv, str(out)])
    assert info.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_make_tiny_never_writes_over_a_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by QA: make-tiny over an I-DLM checkpoint kept its chat template and vocabulary
    under the new LLaDA one, and a failed write over a checkpoint left it unloadable."""
    from dllm_serve_train.tiny_checkpoints import main

    ckpt = write_tiny("idlm", tmp_path / "idlm", seed=1)
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    for argv in ([str(ckpt)], [str(ckpt), "--d-model", "30"], ["--family", "llada2", str(ckpt)]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        assert "exists and is not an empty directory" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit):  # a failed write into an empty directory leaves it empty
        main([str(empty), "--d-model", "65"])
    assert empty.is_dir() and not any(empty.iterdir())
    assert main([str(empty)]) == 0 and (empty / "config.json").is_file()
