"""Resolving a model id from a fake local Hugging Face cache (offline), and the memory check."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dllm_serve.models.loader import (
    InsufficientMemoryError,
    ModelLoadError,
    load_model,
    resolve_model_path,
)
from dllm_serve_train.tiny_checkpoints import write_tiny_llada


@pytest.fixture(scope="module")
def single_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llada(tmp_path_factory.mktemp("hub") / "tiny-one", n_layers=1)


def fake_hub(root: Path, repo: str, src: Path, commit: str = "0" * 40, ref: str | None = "main"):
    """A huggingface_hub-style cache entry holding a copy of ``src``."""
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    shutil.copytree(src, repo_dir / "snapshots" / commit)
    if ref is not None:
        (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
        (repo_dir / "refs" / ref).write_text(commit)
    return repo_dir / "snapshots" / commit


@pytest.fixture
def clean_hf_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_hf_id_from_hub_cache(single_dir: Path, clean_hf_env: Path, monkeypatch) -> None:
    cache = clean_hf_env / "hub"
    snap = fake_hub(cache, "GSAI-ML/tiny-llada", single_dir, commit="a" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model_path("GSAI-ML/tiny-llada") == snap
    loaded = load_model("GSAI-ML/tiny-llada")
    assert loaded.name == "GSAI-ML/tiny-llada" and loaded.path == snap


def test_hf_home_and_default_cache(single_dir: Path, clean_hf_env: Path, monkeypatch) -> None:
    snap = fake_hub(clean_hf_env / "hfhome" / "hub", "org/m", single_dir)
    monkeypatch.setenv("HF_HOME", str(clean_hf_env / "hfhome"))
    assert resolve_model_path("org/m") == snap
    monkeypatch.delenv("HF_HOME")
    snap = fake_hub(clean_hf_env / "home" / ".cache" / "huggingface" / "hub", "org/m", single_dir)
    assert resolve_model_path("org/m") == snap


def test_hf_revisions(single_dir: Path, clean_hf_env: Path, monkeypatch) -> None:
    cache = clean_hf_env / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    main = fake_hub(cache, "org/m", single_dir, commit="1" * 40)
    dev = fake_hub(cache, "org/m", single_dir, commit="2" * 40, ref="dev")
    assert resolve_model_path("org/m") == main
    assert resolve_model_path("org/m", revision="dev") == dev
    assert resolve_model_path("org/m", revision="2" * 40) == dev
    # Files copied in by hand, no refs at all: the only snapshot is used.
    only = fake_hub(cache, "org/norefs", single_dir, ref=None)
    assert resolve_model_path("org/norefs") == only


def test_hf_id_missing_names_paths_tried(clean_hf_env: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(clean_hf_env / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError) as e:
        load_model("GSAI-ML/LLaDA-8B-Instruct")
    message = str(e.value)
    assert str(clean_hf_env / "hub" / "models--GSAI-ML--LLaDA-8B-Instruct") in message
    assert "never downloads" in message and "HF_HUB_OFFLINE=1" in message


def test_hf_id_missing_suggests_the_hf_command(clean_hf_env: Path, monkeypatch) -> None:
    """`huggingface-cli download` no longer works in huggingface_hub >= 1.0: the message gives
    the `hf` command, with the revision asked for."""
    monkeypatch.setenv("HF_HUB_CACHE", str(clean_hf_env / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError) as e:
        resolve_model_path("GSAI-ML/LLaDA-8B-Instruct")
    message = str(e.value)
    assert (
        "fetch the checkpoint into the cache first with `hf download GSAI-ML/LLaDA-8B-Instruct`"
        in message
    )
    assert "huggingface-cli" not in message
    with pytest.raises(ModelLoadError, match=r"`hf download org/m --revision dev`"):
        resolve_model_path("org/m", revision="dev")


def test_the_suggested_hf_command_exists() -> None:
    """The installed huggingface_hub ships the `hf` command, with `download REPO_ID
    [--revision]`."""
    from importlib.metadata import entry_points

    (hf,) = entry_points(group="console_scripts", name="hf")
    module, _, func = hf.value.partition(":")
    code = f"from {module} import {func}; {func}()"
    env = {**os.environ, "NO_COLOR": "1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code, "download", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert "REPO_ID" in out.stdout and "--revision" in out.stdout


@pytest.mark.parametrize(
    "name", ["/does/not/exist", "./models/llada", "../llada", "~/no-such-model", "a/b/c", "org/"]
)
def test_missing_path_says_the_directory_does_not_exist(name: str, clean_hf_env: Path) -> None:
    """A name that can only be a path gets no Hub advice: the directory is missing."""
    with pytest.raises(ModelLoadError) as e:
        resolve_model_path(name)
    resolved = Path(name).expanduser().resolve()
    assert str(e.value) == (
        f"model {name!r}: directory {resolved} does not exist. Pass a checkpoint directory "
        "(config.json, tokenizer files, *.safetensors), a model id already in the Hugging Face "
        "cache, or an embedded model. Embedded models: demo-idlm, demo-llada, demo-trimode, "
        "tiny-llada"
    )


def test_a_file_is_not_a_checkpoint_directory(clean_hf_env: Path) -> None:
    (clean_hf_env / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"model\.safetensors is not a directory"):
        resolve_model_path("model.safetensors")


def test_incomplete_snapshot(single_dir: Path, clean_hf_env: Path, monkeypatch) -> None:
    cache = clean_hf_env / "hub"
    snap = fake_hub(cache, "org/half", single_dir)
    (snap / "config.json").unlink()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    with pytest.raises(ModelLoadError, match="incomplete download"):
        load_model("org/half")


# ---- memory ----------------------------------------------------------------------------------
def test_too_little_memory_refused_before_reading(
    single_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dllm_serve.models import loader, memory

    monkeypatch.setattr(memory, "available_bytes", lambda device: 1000)
    monkeypatch.setattr(loader, "_load_weights", lambda *a: pytest.fail("weights were read"))
    with pytest.raises(InsufficientMemoryError, match=r"need 0\.00 GiB in float32.*cpu has only"):
        load_model(str(single_dir))
    monkeypatch.setenv(memory.SKIP_ENV, "1")  # the escape hatch reaches the weights

    class ReachedWeights(Exception):
        pass

    def reached(*_: object) -> None:
        raise ReachedWeights

    monkeypatch.setattr(loader, "_load_weights", reached)
    with pytest.raises(ReachedWeights):
        load_model(str(single_dir))


def test_weight_bytes_match_the_real_index() -> None:
    from dllm_serve.models.families import family_for
    from dllm_serve.models.memory import weight_bytes

    for name in ("llada-8b-instruct", "dream-v0-instruct-7b"):
        real = Path(__file__).resolve().parents[2] / "fixtures" / name
        config = json.loads((real / "config.json").read_text())
        total, largest = weight_bytes(family_for(config).transformer_config(config), torch.bfloat16)
        index = json.loads((real / "model.safetensors.index.json").read_text())
        assert total == index["metadata"]["total_size"]
        assert (
            largest == config["vocab_size"] * config.get("d_model", config.get("hidden_size")) * 2
        )


def test_available_memory_is_known_on_this_host() -> None:
    from dllm_serve.models.memory import available_bytes

    free = available_bytes(torch.device("cpu"))
    assert free is not None and free > 0
