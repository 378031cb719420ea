"""Checkpoint directory -> ready-to-run model, tokenizer and special ids.

Reads ``config.json`` (and ``generation_config.json``), picks the family, checks that the
safetensors hold exactly the tensors the family expects with the right shapes, and loads them
into a :class:`DecoderTransformer` without ever instantiating random weights (the module is
built on the meta device). No remote code is executed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from dllm_serve.models.families import Family, family_for
from dllm_serve.models.transformer import DecoderTransformer, TransformerConfig


class ModelLoadError(RuntimeError):
    """A checkpoint could not be found or does not match what its config describes."""


_ASSETS = Path(__file__).resolve().parent.parent / "assets"
EMBEDDED_MODELS: dict[str, str] = {"tiny-llada": str(_ASSETS / "tiny-llada")}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """A loaded checkpoint: the network, its tokenizer, its family and its special ids."""

    name: str
    path: Path
    model: DecoderTransformer
    tokenizer: Any
    family: Family
    mask_id: int
    eos_id: int
    eot_id: int | None
    bos_id: int | None
    pad_id: int | None
    stop_ids: tuple[int, ...]
    max_length: int
    device: torch.device
    dtype: torch.dtype

    def chat_prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of the rendered chat prompt, ending with the assistant header."""
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        # The template inserts BOS itself; letting the tokenizer add specials would double it.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` without special tokens, spaces exactly as generated."""
        return self.tokenizer.decode(
            ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )


def resolve_model_path(name_or_path: str) -> Path:
    """An embedded model name or a local checkpoint directory -> its directory."""
    if name_or_path in EMBEDDED_MODELS:
        return Path(EMBEDDED_MODELS[name_or_path])
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    raise ModelLoadError(
        f"model {name_or_path!r} not found: no directory at {path.resolve()} and no embedded "
        f"model of that name (embedded: {', '.join(sorted(EMBEDDED_MODELS))})"
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ModelLoadError(f"invalid device {device!r}: {e}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} requested but CUDA is not available")
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise ModelLoadError(f"device {device!r}: only {torch.cuda.device_count()} GPU(s) visible")
    if dev.type not in ("cpu", "cuda"):
        raise ModelLoadError(f"unsupported device {device!r}; use cpu, cuda, cuda:N or auto")
    return dev


def _resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        # bf16 halves memory and is what the checkpoints are stored in; CPU kernels are
        # faster and more accurate in fp32.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; use auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def _weight_files(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (single file or sharded index)."""
    single = path / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index} has no 'weight_map'")
        files = {name: path / fname for name, fname in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise ModelLoadError(f"shard {shard} listed in {index.name} is missing")
        return files
    raise ModelLoadError(f"no model.safetensors or model.safetensors.index.json in {path}")


def _load_weights(
    path: Path, family: Family, tcfg: TransformerConfig, device: torch.device, dtype: torch.dtype
) -> DecoderTransformer:
    files = _weight_files(path)
    expected = family.weight_map(tcfg)
    missing = sorted(set(expected) - set(files))
    unexpected = sorted(set(files) - set(expected))
    if missing or unexpected:
        raise ModelLoadError(
            f"checkpoint tensors in {path} do not match its config.json: "
            f"missing {missing or 'none'}; unexpected {unexpected or 'none'}"
        )
    with torch.device("meta"):
        model = DecoderTransformer(tcfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    state: dict[str, torch.Tensor] = {}
    wrong: list[str] = []
    for shard in sorted(set(files.values())):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                if files.get(name) != shard:
                    continue  # an index may point a name at another shard; trust the index
                ours = expected[name]
                shape = tuple(f.get_slice(name).get_shape())
                if shape != shapes[ours]:
                    wrong.append(
                        f"{name}: checkpoint {list(shape)}, config implies {list(shapes[ours])}"
                    )
                    continue
                state[ours] = f.get_tensor(name).to(device=device, dtype=dtype)
    if wrong:
        raise ModelLoadError(
            f"tensor shapes in {path} do not match config.json: " + "; ".join(wrong)
        )
    absent = sorted(n for n, ours in expected.items() if ours not in state)
    if absent:
        raise ModelLoadError(f"tensors listed in the index but absent from their shard: {absent}")
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)
    return model.eval()


def _first_id(value: Any) -> int | None:
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def _token_id(tokenizer: Any, token: str | None) -> int | None:
    if token is None:
        return None
    # convert_tokens_to_ids falls back to unk (or None) for unknown strings; the vocab does not.
    return tokenizer.get_vocab().get(token)


def _special_ids(
    config: dict[str, Any], gen: dict[str, Any], tokenizer: Any, family: Family, vocab: int
) -> dict[str, Any]:
    """mask/eos/eot/bos/pad/stop ids, from config.json first, then generation_config, then
    the tokenizer; never from constants, since every checkpoint family numbers them its own way.
    """
    mask_id = _first_id(config.get("mask_token_id"))
    if mask_id is None:
        mask_id = _token_id(tokenizer, family.mask_token)
    eos_raw = config.get("eos_token_id", gen.get("eos_token_id", tokenizer.eos_token_id))
    eos_id = _first_id(eos_raw)
    if mask_id is None or eos_id is None:
        raise ModelLoadError(
            f"cannot determine the mask id ({family.mask_token!r}) or the EOS id "
            "from config.json, generation_config.json or the tokenizer"
        )
    eot_id = _token_id(tokenizer, family.eot_token)
    ids = {
        "mask_id": mask_id,
        "eos_id": eos_id,
        "eot_id": eot_id,
        "bos_id": _first_id(
            gen.get("bos_token_id", config.get("bos_token_id", tokenizer.bos_token_id))
        ),
        "pad_id": _first_id(config.get("pad_token_id", tokenizer.pad_token_id)),
    }
    bad = {k: v for k, v in ids.items() if v is not None and not 0 <= v < vocab}
    if bad:
        raise ModelLoadError(f"special ids {bad} lie outside the {vocab}-row vocabulary")
    if mask_id == ids["pad_id"]:
        raise ModelLoadError(f"the mask id {mask_id} equals the pad id")
    extra_eos = [int(i) for i in eos_raw] if isinstance(eos_raw, list) else []
    stops = {eos_id, *extra_eos} | ({eot_id} if eot_id is not None else set())
    return {**ids, "stop_ids": tuple(sorted(stops))}


def load_model(name_or_path: str, device: str = "cpu", dtype: str = "auto") -> LoadedModel:
    """Load a checkpoint by embedded name or directory onto ``device`` in ``dtype``."""
    from transformers import AutoTokenizer, PreTrainedConfig  # heavy import, only needed here

    path = resolve_model_path(name_or_path)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"no config.json in {path}")
    config = _read_json(path / "config.json")
    gen_path = path / "generation_config.json"
    gen = _read_json(gen_path) if gen_path.is_file() else {}
    family = family_for(config)
    tcfg = family.transformer_config(config)
    dev = _resolve_device(device)
    dt = _resolve_dtype(dtype, dev)
    # Tokenizer and ids first: they are cheap, so a broken checkpoint fails before gigabytes
    # of weights are read.
    try:
        # An empty config stops AutoTokenizer from parsing config.json as a transformers
        # model config (model_type "llada" is unknown to it, and it would look for remote
        # code); the class then comes from tokenizer_config.json alone.
        tokenizer = AutoTokenizer.from_pretrained(
            str(path), config=PreTrainedConfig(), trust_remote_code=False
        )
    except Exception as e:  # transformers raises many types; all mean "unusable tokenizer"
        raise ModelLoadError(f"cannot load the tokenizer in {path}: {e}") from e
    try:
        ids = _special_ids(config, gen, tokenizer, family, tcfg.vocab_size)
    except ModelLoadError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    model = _load_weights(path, family, tcfg, dev, dt)
    return LoadedModel(
        name=name_or_path if name_or_path in EMBEDDED_MODELS else path.resolve().name,
        path=path,
        model=model,
        tokenizer=tokenizer,
        family=family,
        max_length=tcfg.max_sequence_length,
        device=dev,
        dtype=dt,
        **ids,
    )
