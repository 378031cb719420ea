"""load_model on the tiny checkpoints of each family, on broken copies, and via a fake HF cache."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dllm_serve.models.families import DREAM, LLADA, SDAR, UnsupportedModelError
from dllm_serve.models.loader import (
    EMBEDDED_MODELS,
    ModelLoadError,
    load_model,
    resolve_model_path,
)
from dllm_serve_train.tiny_checkpoints import write_tiny_dream, write_tiny_idlm, write_tiny_llada

HELLO = (
    "<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nhello<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llada")


@pytest.fixture(scope="module")
def single_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llada(tmp_path_factory.mktemp("one") / "tiny-one")


def broken_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_embedded_model_loads(tiny) -> None:
    assert tiny.name == "tiny-llada"
    assert tiny.path == Path(EMBEDDED_MODELS["tiny-llada"]) == resolve_model_path("tiny-llada")
    assert tiny.family is LLADA
    assert tiny.device == torch.device("cpu") and tiny.dtype == torch.float32
    assert not tiny.model.training
    assert all(not p.requires_grad for p in tiny.model.parameters())
    assert all(p.dtype == torch.float32 for p in tiny.model.parameters())


def test_special_ids_come_from_config_and_tokenizer(tiny) -> None:
    config = json.loads((tiny.path / "config.json").read_text())
    gen = json.loads((tiny.path / "generation_config.json").read_text())
    tok = tiny.tokenizer
    assert tiny.mask_id == config["mask_token_id"] == tok.convert_tokens_to_ids("<|mdm_mask|>")
    assert tiny.eos_id == config["eos_token_id"] == tok.eos_token_id
    assert tiny.pad_id == config["pad_token_id"] == tok.pad_token_id
    assert tiny.bos_id == gen["bos_token_id"] == tok.bos_token_id
    assert tiny.eot_id == tok.convert_tokens_to_ids("<|eot_id|>")
    assert tiny.stop_ids == tuple(sorted({tiny.eos_id, tiny.eot_id}))
    assert tiny.max_length == config["max_sequence_length"]
    assert tiny.model.config.vocab_size == config["embedding_size"]


def test_chat_prompt_renders_exactly(tiny) -> None:
    ids = tiny.chat_prompt_ids([{"role": "user", "content": "hello"}])
    assert ids[0] == tiny.bos_id and ids.count(tiny.bos_id) == 1
    assert tiny.tokenizer.decode(ids, skip_special_tokens=False) == HELLO
    assert tiny.decode(ids) == "user\n\nhelloassistant\n\n"


def test_decode_keeps_spacing(tiny) -> None:
    text = "  Hello ,  world !  ünïcødé 🙂\n"
    assert tiny.decode(tiny.tokenizer.encode(text, add_special_tokens=False)) == text


def test_directory_name_and_bf16(single_dir: Path) -> None:
    loaded = load_model(str(single_dir), dtype="bfloat16")
    assert loaded.name == "tiny-one"
    assert loaded.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())


def test_two_shards_give_identical_logits(single_dir: Path, tmp_path: Path) -> None:
    sharded = write_tiny_llada(tmp_path / "two", num_shards=2)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert not (sharded / "model.safetensors").exists()
    a, b = load_model(str(single_dir)), load_model(str(sharded))
    ids = torch.tensor([a.chat_prompt_ids([{"role": "user", "content": "hi there"}])])
    pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        la = a.model.lm_head(a.model(ids, pos))
        lb = b.model.lm_head(b.model(ids, pos))
    assert torch.equal(la, lb)


def rewrite_weights(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_missing_tensor_named(single_dir: Path, tmp_path: Path) -> None:
    path = broken_copy(single_dir, tmp_path / "m")
    rewrite_weights(path, lambda t: t.pop("model.transformer.blocks.1.up_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"blocks\.1\.up_proj\.weight"):
        load_model(str(path))


def test_unexpected_tensor_named(single_dir: Path, tmp_path: Path) -> None:
    path = broken_copy(single_dir, tmp_path / "u")
    rewrite_weights(path, lambda t: t.update({"model.transformer.wpe.weight": torch.zeros(4, 4)}))
    with pytest.raises(ModelLoadError, match=r"model\.transformer\.wpe\.weight"):
        load_model(str(path))


def test_wrong_shape_named(single_dir: Path, tmp_path: Path) -> None:
    path = broken_copy(single_dir, tmp_path / "s")
    rewrite_weights(path, lambda t: t.update({"model.transformer.ln_f.weight": torch.ones(65)}))
    with pytest.raises(ModelLoadError, match=r"ln_f\.weight: checkpoint \[65\]"):
        load_model(str(path))


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_unknown_model_type(single_dir: Path, tmp_path: Path) -> None:
    path = broken_copy(single_dir, tmp_path / "t")
    edit_config(path, model_type="mystery")
    with pytest.raises(UnsupportedModelError, match="llada"):
        load_model(str(path))


def test_moe_config_rejected(single_dir: Path, tmp_path: Path) -> None:
    path = broken_copy(single_dir, tmp_path / "moe")
    edit_config(path, architectures=["OlmoeForCausalLM"], model_type="olmoe")
    with pytest.raises(UnsupportedModelError, match="mixture-of-experts"):
        load_model(str(path))
    # A LLaDA-8B config naming LLaDA-MoE's architecture is LLaDA-MoE's, and lacks its keys.
    edit_config(path, architectures=["LLaDAMoEModelLM"], model_type="llada")
    with pytest.raises(UnsupportedModelError, match=r"LLaDA-MoE config\.json lacks required key"):
        load_model(str(path))


def test_mask_id_falls_back_to_tokenizer(single_dir: Path, tmp_path: Path) -> None:
    path = broken_copy(single_dir, tmp_path / "nomask")
    config = json.loads((path / "config.json").read_text())
    want = config.pop("mask_token_id")
    (path / "config.json").write_text(json.dumps(config))
    assert load_model(str(path)).mask_id == want


def test_nonexistent_path_named(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError, match="no-such-model"):
        load_model(str(missing))


def test_directory_without_weights(single_dir: Path, tmp_path: Path) -> None:
    path = broken_copy(single_dir, tmp_path / "nw")
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no model\.safetensors"):
        load_model(str(path))


@pytest.mark.parametrize(("device", "dtype"), [("cpu", "float64"), ("tpu", "auto")])
def test_bad_device_or_dtype(device: str, dtype: str) -> None:
    with pytest.raises(ModelLoadError):
        load_model("tiny-llada", device=device, dtype=dtype)


# ---- Dream / I-DLM checkpoints ----------------------------------------------------------------
@pytest.fixture(scope="module")
def dream_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_dream(tmp_path_factory.mktemp("dream") / "tiny-dream")


@pytest.fixture(scope="module")
def idlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_idlm(tmp_path_factory.mktemp("idlm") / "tiny-idlm", num_shards=2)


def test_dream_loads_without_remote_code(dream_dir: Path) -> None:
    tok_cfg = json.loads((dream_dir / "tokenizer_config.json").read_text())
    assert tok_cfg["tokenizer_class"] == "DreamTokenizer" and "auto_map" in tok_cfg
    loaded = load_model(str(dream_dir))
    assert loaded.family is DREAM
    assert type(loaded.tokenizer).__name__ == "Qwen2Tokenizer"
    tok = loaded.tokenizer
    assert loaded.mask_id == tok.mask_token_id == tok.convert_tokens_to_ids("<|mask|>")
    assert loaded.eos_id == loaded.pad_id == tok.convert_tokens_to_ids("<|endoftext|>")
    assert loaded.eot_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert loaded.stop_ids == tuple(sorted({loaded.eos_id, loaded.eot_id}))
    assert loaded.max_length == 2048 and loaded.config["model_type"] == "Dream"


def test_idlm_loads_sharded(idlm_dir: Path) -> None:
    loaded = load_model(str(idlm_dir))
    assert loaded.family is SDAR and not loaded.family.bidirectional
    tok = loaded.tokenizer
    assert loaded.mask_id == tok.mask_token_id == tok.convert_tokens_to_ids("<|MASK|>")
    assert loaded.eos_id == loaded.eot_id == tok.convert_tokens_to_ids("<|im_end|>")
    # I-DLM also stops at <|endoftext|> (Qwen3's second EOS).
    assert loaded.stop_ids == tuple(
        sorted({loaded.eos_id, tok.convert_tokens_to_ids("<|endoftext|>")})
    )
    assert loaded.model.config.qk_norm and loaded.model.config.head_dim == 16


def rewrite_as_transformers_v5(path: Path) -> None:
    """What transformers 5.x save_pretrained writes: dtype, rope_parameters, layer_types, and
    the chat template in its own file."""
    config = json.loads((path / "config.json").read_text())
    config["dtype"] = config.pop("torch_dtype")
    config["rope_parameters"] = {"rope_theta": config.pop("rope_theta"), "rope_type": "default"}
    config.pop("rope_scaling")
    config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    config["transformers_version"] = "5.24.0"
    (path / "config.json").write_text(json.dumps(config))
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    if "chat_template" in tok_cfg:
        (path / "chat_template.jinja").write_text(tok_cfg.pop("chat_template"))
    else:  # and the other way round: a 4.x file with the template inline
        tok_cfg["chat_template"] = (path / "chat_template.jinja").read_text()
        (path / "chat_template.jinja").unlink()
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg))


@pytest.mark.parametrize("which", ["dream", "idlm"])
def test_transformers_v4_and_v5_files_load_the_same(which: str, request, tmp_path: Path) -> None:
    src: Path = request.getfixturevalue(f"{which}_dir")
    other = broken_copy(src, tmp_path / "v5")
    rewrite_as_transformers_v5(other)
    a, b = load_model(str(src)), load_model(str(other))
    assert a.model.config == b.model.config
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "and?"}]  # fmt: skip
    assert a.chat_prompt_ids(messages) == b.chat_prompt_ids(messages)


def test_checkpoint_dtype_keys() -> None:
    from dllm_serve.models.loader import checkpoint_dtype

    assert checkpoint_dtype({"torch_dtype": "bfloat16"}) is torch.bfloat16
    assert checkpoint_dtype({"dtype": "float16"}) is torch.float16
    assert checkpoint_dtype({}) is None


def test_ignorable_rope_buffers_accepted(idlm_dir: Path, tmp_path: Path) -> None:
    path = broken_copy(idlm_dir, tmp_path / "buf")
    shard = path / "model-00001-of-00002.safetensors"
    tensors = load_file(shard)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.self_attn.rotary_emb.inv_freq"] = shard.name
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert load_model(str(path)).family is SDAR


def test_shard_listed_but_missing(idlm_dir: Path, tmp_path: Path) -> None:
    path = broken_copy(idlm_dir, tmp_path / "shard")
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"model-00002-of-00002\.safetensors"):
        load_model(str(path))


# ---- more bad checkpoints: one clear error each -------------------------------------------
def test_missing_tokenizer(single_dir: Path, tmp_path: Path) -> None:
    path = broken_copy(single_dir, tmp_path / "notok")
    (path / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"no tokenizer in .*notok"):
        load_model(str(path))


def test_remote_code_tokenizer_without_fallback(single_dir: Path, tmp_path: Path) -> None:
    path = broken_copy(single_dir, tmp_path / "remotetok")
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    tok_cfg["tokenizer_class"] = "LLaDATokenizer"
    tok_cfg["auto_map"] = {"AutoTokenizer": ["tokenization_llada.LLaDATokenizer", None]}
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    with pytest.raises(ModelLoadError, match=r"LLaDATokenizer.*remote code"):
        load_model(str(path))


def test_trust_remote_code_only_config(single_dir: Path, tmp_path: Path) -> None:
    path = broken_copy(single_dir, tmp_path / "remote")
    edit_config(path, model_type="mdlm", architectures=["MDLM"],
                auto_map={"AutoModelForMaskedLM": "modeling_mdlm.MDLM"})  # fmt: skip
    with pytest.raises(UnsupportedModelError, match="only by the checkpoint's own remote code"):
        load_model(str(path))


def test_progress_bar_quiet_without_tty(single_dir: Path, capfd: pytest.CaptureFixture) -> None:
    import logging

    logging.getLogger("dllm_serve.models.loader").setLevel(logging.INFO)
    try:
        load_model(str(single_dir))
    finally:
        logging.getLogger("dllm_serve.models.loader").setLevel(logging.NOTSET)
    assert "Loading" not in capfd.readouterr().err


# ---- unreadable and corrupt weights: one ModelLoadError naming the file and the cause --------
def _deny_reading(monkeypatch: pytest.MonkeyPatch, denied: Path) -> None:
    """The checkpoint reader's `open` raises PermissionError for `denied`, as for a mode-0600
    file owned by another user (tests run as root, which chmod alone does not stop)."""
    from dllm_serve.models import checkpoint_files

    def fake_open(file, *args, **kwargs):
        if Path(file) == denied:
            raise PermissionError(13, "Permission denied", str(file))
        return open(file, *args, **kwargs)

    monkeypatch.setattr(checkpoint_files, "open", fake_open, raising=False)


def test_unreadable_weights_named_with_the_permission_problem(
    single_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = broken_copy(single_dir, tmp_path / "perm")
    weights = path / "model.safetensors"
    weights.chmod(0o600)
    _deny_reading(monkeypatch, weights)
    with pytest.raises(ModelLoadError) as e:
        load_model(str(path))
    assert str(e.value) == (
        f"cannot read {weights}: permission denied (mode -rw-------, owner uid "
        f"{weights.stat().st_uid}; this process runs as uid {os.geteuid()}). Make the checkpoint "
        f"readable by this user, e.g. `chmod a+r {weights}` (and a+x on its directories)"
    )
    assert e.value.__cause__ is None and e.value.__suppress_context__


def test_unreadable_shard_fails_before_any_weight_is_loaded(
    idlm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dllm_serve.models import loader

    path = broken_copy(idlm_dir, tmp_path / "permshard")
    _deny_reading(monkeypatch, path / "model-00002-of-00002.safetensors")
    monkeypatch.setattr(loader, "DecoderTransformer", lambda *a: pytest.fail("weights loaded"))
    with pytest.raises(ModelLoadError, match=r"model-00002-of-00002\.safetensors: permission"):
        load_model(str(path))


def _without_read_permission() -> list[str] | None:
    """A command prefix under which a mode-000 file really is unreadable: none needed for a
    non-root user; for root, setpriv dropping the capabilities that bypass file modes."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    probe = subprocess.run(
        [setpriv, "--bounding-set=-dac_override,-dac_read_search", "true"], capture_output=True
    )
    return (
        [setpriv, "--bounding-set=-dac_override,-dac_read_search"]
        if probe.returncode == 0
        else None
    )


def test_mode_000_weights_really_unreadable(single_dir: Path, tmp_path: Path) -> None:
    """The real thing, in a child process: safetensors alone would say `FileNotFoundError: No
    such file or directory` for a file that is there."""
    prefix = _without_read_permission()
    if prefix is None:
        pytest.skip("running as root without setpriv: cannot make a file unreadable")
    path = broken_copy(single_dir, tmp_path / "mode000")
    (path / "model.safetensors").chmod(0o000)
    code = (
        "import sys\nfrom dllm_serve.models.loader import ModelLoadError, load_model\n"
        "try:\n    load_model(sys.argv[1])\nexcept ModelLoadError as e:\n    print(e)\n"
    )
    out = subprocess.run(
        [*prefix, sys.executable, "-c", code, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(
        f"cannot read {path / 'model.safetensors'}: permission denied (mode ----------"
    ), out.stdout


@pytest.mark.parametrize(
    ("damage", "detail"),
    [
        ("truncated", "incomplete metadata, file not fully covered"),
        ("header", "invalid header length"),
        ("empty", "header too small"),
    ],
)
def test_corrupt_weights_give_one_clear_error(
    single_dir: Path, tmp_path: Path, damage: str, detail: str
) -> None:
    path = broken_copy(single_dir, tmp_path / damage)
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(
        {"truncated": data[: len(data) // 2], "header": data[:100], "empty": b""}[damage]
    )
    with pytest.raises(ModelLoadError) as e:
        load_model(str(path))
    assert str(e.value) == (
        f"cannot read {weights}: not a valid safetensors file, truncated or corrupt (Error "
        f"while deserializing header: {detail}); copy or download it again"
    )


def test_corrupt_shard_named(idlm_dir: Path, tmp_path: Path) -> None:
    path = broken_copy(idlm_dir, tmp_path / "badshard")
    shard = path / "model-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    expected = re.escape(f"cannot read {shard}: not a valid safetensors file")
    with pytest.raises(ModelLoadError, match=expected):
        load_model(str(path))


def _edited_copy(src: Path, dst: Path, name: str, text: str | None) -> Path:
    shutil.copytree(src, dst)
    if text is not None:
        (dst / name).write_text(text, encoding="utf-8")
    return dst


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("config.json", "[1, 2]", "holds a JSON list, not an object"),
        ("config.json", "null", "holds a JSON NoneType, not an object"),
        ("generation_config.json", "[]", "holds a JSON list, not an object"),
    ],
)
def test_a_json_file_that_is_not_an_object_is_one_clear_error(
    single_dir: Path, tmp_path: Path, name: str, text: str, message: str
) -> None:
    # Found by QA: an AttributeError traceback at start-up.
    broken = _edited_copy(single_dir, tmp_path / "m", name, text)
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        load_model(str(broken))


def test_a_config_that_is_not_utf8_is_one_clear_error(single_dir: Path, tmp_path: Path) -> None:
    broken = _edited_copy(single_dir, tmp_path / "m", "config.json", None)
    (broken / "config.json").write_bytes(b'{"model_type": "llada\xff"}')
    with pytest.raises(ModelLoadError, match="not UTF-8 text"):
        load_model(str(broken))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"n_heads": 3}, "d_model 64 is not divisible by n_heads 3"),
        ({"rope_theta": "abc"}, "config.json"),
        ({"max_sequence_length": 0}, "must be an integer >= 2, got 0"),
        ({"n_layers": 0}, "n_layers must be a positive integer, got 0"),
    ],
)
def test_config_values_of_the_wrong_shape_are_one_clear_error(
    single_dir: Path, tmp_path: Path, change: dict, message: str
) -> None:
    # Found by QA: raw ValueError tracebacks at start-up, or (a context of 0) a server that
    # started and refused every request.
    config = json.loads((single_dir / "config.json").read_text())
    broken = _edited_copy(single_dir, tmp_path / "m", "config.json", json.dumps(config | change))
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        load_model(str(broken))


def test_a_shard_index_entry_without_a_file_is_one_clear_error(
    idlm_dir: Path, tmp_path: Path
) -> None:
    index = json.loads((idlm_dir / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = None
    broken = _edited_copy(
        idlm_dir, tmp_path / "m", "model.safetensors.index.json", json.dumps(index)
    )
    with pytest.raises(ModelLoadError, match="'weight_map' names no file"):
        load_model(str(broken))
