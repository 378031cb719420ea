"""Reading and checking a checkpoint's files: JSON configs, ``generation_config.json``
values, and the safetensors weights (single file or sharded index), each failure one
:class:`ModelLoadError` naming the file and the cause."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from dllm_serve.models.errors import ModelLoadError


def read_json(path: Path) -> dict[str, Any]:
    """A checkpoint's JSON file, which must hold one object (every config file does)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ModelLoadError(f"cannot read {path}: not UTF-8 text ({e.reason})") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    if not isinstance(value, dict):
        raise ModelLoadError(
            f"cannot read {path}: it holds a JSON {type(value).__name__}, not an object"
        )
    return value


def _check_readable(path: Path) -> None:
    """Raise a :class:`ModelLoadError` naming ``path`` and the cause when this process cannot
    read it. safetensors reports any failure to open a file, a permission denied included, as
    ``FileNotFoundError: No such file or directory``: opening it ourselves first gives the
    real reason."""
    try:
        with open(path, "rb") as f:
            f.read(1)
    except PermissionError:
        raise ModelLoadError(_permission_message(path)) from None
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e.strerror or e}") from None


def _permission_message(path: Path) -> str:
    try:
        st = path.stat()
        owner = f"mode {stat.filemode(st.st_mode)}, owner uid {st.st_uid}"
    except OSError:
        owner = "its directory is not searchable"
    return (
        f"cannot read {path}: permission denied ({owner}; this process runs as uid "
        f"{os.geteuid()}). Make the checkpoint readable by this user, e.g. "
        f"`chmod a+r {path}` (and a+x on its directories)"
    )


@contextmanager
def open_safetensors(path: Path) -> Iterator[Any]:
    """``safe_open(path)`` whose failures are one clear :class:`ModelLoadError`: unreadable,
    truncated or not a safetensors file at all (also while tensors are being read)."""
    _check_readable(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            yield f
    except SafetensorError as e:
        raise ModelLoadError(
            f"cannot read {path}: not a valid safetensors file, truncated or corrupt ({e}); "
            "copy or download it again"
        ) from None
    except OSError as e:  # e.g. changed since the check above, or an I/O error mid-read
        raise ModelLoadError(f"cannot read {path}: {e}") from None


def weight_files(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (single file or sharded index). Every
    file is opened once here, so an unreadable or corrupt one fails before any is loaded."""
    single = path / "model.safetensors"
    if single.is_file():
        with open_safetensors(single) as f:
            return dict.fromkeys(f.keys(), single)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index} has no 'weight_map'")
        bad = sorted(name for name, fname in weight_map.items() if not isinstance(fname, str))
        if bad:
            raise ModelLoadError(f"{index}: 'weight_map' names no file for {bad[:5]}")
        files = {name: path / fname for name, fname in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise ModelLoadError(f"shard {shard} listed in {index.name} is missing")
            with open_safetensors(shard):
                pass  # the header parses: readable and not truncated
        return files
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        raise ModelLoadError(
            f"{path} holds only pickled weights (.bin/.pt); convert to safetensors"
        )
    raise ModelLoadError(f"no model.safetensors or model.safetensors.index.json in {path}")


def default_gen_length(gen: dict[str, Any], gen_path: Path) -> int | None:
    return positive_int(gen, "max_new_tokens", gen_path)


def positive_int(gen: dict[str, Any], key: str, gen_path: Path) -> int | None:
    return _int_at_least(gen, key, gen_path, 1, "a positive integer")


def non_negative_int(gen: dict[str, Any], key: str, gen_path: Path) -> int | None:
    return _int_at_least(gen, key, gen_path, 0, "a non-negative integer")


def _int_at_least(
    gen: dict[str, Any], key: str, gen_path: Path, minimum: int, what: str
) -> int | None:
    """``gen[key]`` when it is an integer ≥ ``minimum``, None when absent; else refused."""
    value = gen.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ModelLoadError(f"{gen_path}: {key} must be {what}: {value!r}")
    return value
