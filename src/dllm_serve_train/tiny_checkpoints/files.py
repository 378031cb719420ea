"""Writing a tiny checkpoint's files: JSON exactly as the real ones look, and random weights
under the family's real tensor names, single-file or sharded with an index."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dllm_serve.models.families import Family
from dllm_serve.models.transformer import DecoderTransformer, TransformerConfig

FLAGS = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
_FORMATS = Path(__file__).resolve().parent / "formats"
# Every file of a checkpoint is written rw-r--r--, whatever the umask: safetensors creates its
# files 0600, which a server running as another user (the Docker image's UID 10001) cannot read.
FILE_MODE = 0o644
DIR_MODE = 0o755  # and the checkpoint's directory rwxr-xr-x: a 0700 one hides its files


def readable(path: Path) -> Path:
    """Give ``path`` :data:`FILE_MODE` and return it."""
    os.chmod(path, FILE_MODE)
    return path


def make_dir(path: Path) -> None:
    """Create the checkpoint directory (and its parents) and give it :data:`DIR_MODE`,
    whatever the umask."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, DIR_MODE)


def write_text(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")
    readable(path)


def write_json(path: Path, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def real_file(checkpoint: str, name: str) -> Any:
    """A metadata file of a real checkpoint, as stored in ``formats/<checkpoint>/``."""
    text = (_FORMATS / checkpoint / name).read_text(encoding="utf-8")
    return text if name.endswith(".jinja") else json.loads(text)


def random_weights(family: Family, tcfg: TransformerConfig, seed: int) -> dict[str, torch.Tensor]:
    """bf16 tensors under the family's names: norms are ones, everything else randn * 0.02."""
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in DecoderTransformer(tcfg).state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    # Draw in the family's fixed name order so the same seed always gives the same tensors.
    for theirs, ours in family.weight_map(tcfg).items():
        shape = shapes[ours]
        if ours.endswith("norm.weight"):
            t = torch.ones(shape)
        else:
            t = torch.randn(shape, generator=gen) * 0.02
        out[theirs] = t.to(torch.bfloat16).contiguous()
    return out


def save_weights(out: Path, tensors: dict[str, torch.Tensor], num_shards: int) -> None:
    """``model.safetensors``, or ``num_shards`` files plus ``model.safetensors.index.json``,
    all :data:`FILE_MODE`."""
    if not 1 <= num_shards <= len(tensors):
        # Every shard holds at least one tensor (the index names them all, as real ones do).
        raise ValueError(
            f"num_shards must be in [1, {len(tensors)}] (at least one tensor per shard), "
            f"got {num_shards}"
        )
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)  # never leave a mix of single-file and sharded weights
    names = list(tensors)
    if num_shards == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        readable(out / "model.safetensors")
        return
    bounds = [round(i * len(names) / num_shards) for i in range(num_shards + 1)]
    weight_map: dict[str, str] = {}
    for i in range(num_shards):
        fname = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[bounds[i] : bounds[i + 1]]}
        save_file(part, str(out / fname), metadata={"format": "pt"})
        readable(out / fname)
        weight_map.update(dict.fromkeys(part, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_json(out / "model.safetensors.index.json", index)


def round_up(n: int, multiple: int = 64) -> int:
    return -(-n // multiple) * multiple
