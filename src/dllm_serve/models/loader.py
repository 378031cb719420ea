"""Checkpoint -> ready-to-run model, tokenizer and special ids.

Resolves the name (embedded, local directory, or HF cache; see ``hub.py``), reads
``config.json`` (written by transformers 4.x or 5.x) and ``generation_config.json``, picks the
family, loads the tokenizer and ids (cheap, so a broken checkpoint fails before gigabytes are
read), checks that the weights fit in memory, then checks that the safetensors hold exactly
the tensors the family expects with the right shapes and loads them into a
:class:`DecoderTransformer` built on the meta device (no random init). No remote code runs.
The files themselves are read and checked in ``checkpoint_files.py``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from jinja2 import TemplateError

from dllm_serve.models.checkpoint_files import (
    default_gen_length,
    non_negative_int,
    open_safetensors,
    positive_int,
    read_json,
    weight_files,
)
from dllm_serve.models.diffusion_gemma import DiffusionGemmaConfig, load_gemma_slice
from dllm_serve.models.errors import ChatTemplateError, InsufficientMemoryError, ModelLoadError
from dllm_serve.models.families import Family, UnsupportedModelError, family_for
from dllm_serve.models.hub import EMBEDDED_MODELS, resolve_model_path
from dllm_serve.models.memory import check_memory
from dllm_serve.models.network import build_network
from dllm_serve.models.sharding import TPShard, load_slice, local_name, shard_config
from dllm_serve.models.tokenization import load_tokenizer, special_ids
from dllm_serve.models.transformer import DecoderTransformer, TransformerConfig

__all__ = [
    "EMBEDDED_MODELS",
    "InsufficientMemoryError",
    "LoadedModel",
    "ModelLoadError",
    "load_model",
    "resolve_model_path",
]

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """A loaded checkpoint: the network, its tokenizer, its family and its special ids.

    ``family.bidirectional`` / ``family.logit_shift`` tell the decoding layer which attention
    kind and logit convention this checkpoint was trained with.
    """

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
    config: dict[str, Any] = field(default_factory=dict)  # config.json as read
    # generation_config.json's max_new_tokens: the canvas a request gets when it names none
    # (None: the server-wide default). Our demo models set it to the canvas they were trained
    # for; real checkpoints do not set it.
    default_gen_length: int | None = None
    # The block a long canvas is decoded in when a request names none: generation_config.json's
    # block_length, else its max_new_tokens (the canvas our demo models were trained on).
    default_block_length: int | None = None
    # generation_config.json's mask_lookahead: how many masks past the active block a
    # diffusion forward includes (None: the whole canvas, the reference; decoding/canvas.py).
    mask_lookahead: int | None = None
    vocab_size: int = 0  # rows of the embedding: valid token ids are 0 .. vocab_size - 1
    # Block-diffusion families: the trained block (config.json block_size), else None.
    block_size: int | None = None
    # LLaDA2.2's (DELETE, SPLIT) edit-token ids (config.json), else None.
    edit_token_ids: tuple[int, int] | None = None
    # generation_config.json as read ({} when absent): DiffusionGemma's sampler settings.
    generation: dict[str, Any] = field(default_factory=dict)
    # Tensor parallelism: rank 0's TensorParallelGroup (engine/parallel/group.py); None: one
    # process holds the whole model.
    parallel: Any = None

    def prompt_ids(self, text: str) -> list[int]:
        """Token ids of a raw prompt (no chat template), with the tokenizer's own specials."""
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def suffix_ids(self, text: str) -> list[int]:
        """Token ids of an infilling suffix: the text as is, no special tokens (it continues
        the sequence, it does not start one)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def chat_prompt_ids(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of the rendered chat prompt, ending with the assistant header; ``tools``
        are rendered by the template (its own format), as transformers passes them."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ChatTemplateError(
                f"model {self.name!r} has no chat template, so it cannot render chat messages; "
                "send a raw prompt to /v1/completions instead"
            )
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=True
            )
        except TemplateError as e:  # the template's own raise_exception(...), or a bad template
            raise ChatTemplateError(f"the chat template of {self.name!r} refused: {e}") from None
        # The template inserts BOS itself; letting the tokenizer add specials would double it.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` without special tokens, spaces exactly as generated."""
        return decode_answer(self.tokenizer, ids)


def decode_answer(tokenizer: Any, ids: Sequence[int]) -> str:
    """An answer's text: special tokens (EOS padding, stop ids) dropped, spaces exactly as
    generated (no clean-up). The engine decodes with its own copy of the tokenizer."""
    return tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)


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


def checkpoint_dtype(config: dict[str, Any]) -> torch.dtype | None:
    """The dtype the weights were saved in: ``dtype`` (5.x) or ``torch_dtype`` (4.x)."""
    name = config.get("dtype") or config.get("torch_dtype")
    return _DTYPES.get(str(name).removeprefix("torch.")) if name else None


def _resolve_dtype(dtype: str, device: torch.device, config: dict[str, Any]) -> torch.dtype:
    if dtype == "auto":
        # On GPUs the checkpoint's own half precision (bf16 when unknown or fp32): half the
        # memory. On CPU fp32: its kernels are faster and more accurate there.
        if device.type != "cuda":
            return torch.float32
        saved = checkpoint_dtype(config)
        return saved if saved in (torch.bfloat16, torch.float16) else torch.bfloat16
    if dtype not in _DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; use auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def _progress(total: int, desc: str) -> Any:
    """A byte progress bar on stderr, only for humans: a TTY and INFO logging enabled."""
    from tqdm import tqdm  # installed with transformers

    quiet = not sys.stderr.isatty() or not logger.isEnabledFor(logging.INFO)
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=quiet, leave=False)


def _load_weights(
    path: Path,
    family: Family,
    config: dict[str, Any],
    tcfg: TransformerConfig,
    device: torch.device,
    dtype: torch.dtype,
    tp: TPShard | None = None,
) -> DecoderTransformer:
    files = weight_files(path)
    tcfg = family.with_tensors(config, tcfg, set(files))
    expected = family.weight_map(tcfg)
    missing = sorted(set(expected) - set(files))
    unexpected = sorted(
        n for n in set(files) - set(expected) if not family.ignorable_tensor(n, tcfg)
    )
    if missing or unexpected:
        raise ModelLoadError(
            f"checkpoint tensors in {path} do not match its config.json: "
            f"missing {missing or 'none'}; unexpected {unexpected or 'none'}"
        )
    with torch.device("meta"):
        model = build_network(tcfg)
        # Under tensor parallelism: the checkpoint holds the full shapes, this rank a slice.
        local = (
            model
            if tp is None
            else build_network(shard_config(tcfg, tp.size, tp.rank, tp.expert_parallel))
        )
    # DiffusionGemma's per-layer head shapes and stacked experts have slicing rules of their own.
    slicer = load_gemma_slice if isinstance(tcfg, DiffusionGemmaConfig) else load_slice
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    # Our name of each checkpoint tensor on this rank (None: another rank's expert).
    mine = {n: ours if tp is None else local_name(ours, tcfg, tp) for n, ours in expected.items()}
    state: dict[str, torch.Tensor] = {}
    wrong: list[str] = []
    item = torch.empty((), dtype=dtype).element_size()
    total = sum(v.numel() for v in local.state_dict().values()) * item
    with _progress(total, f"Loading {path.name}") as bar:
        for shard in sorted(set(files.values())):
            with open_safetensors(shard) as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    if files.get(name) != shard or name not in expected:
                        continue  # another shard's (trust the index) or an ignorable tensor
                    ours = expected[name]
                    shape = tuple(f.get_slice(name).get_shape())
                    if shape != shapes[ours]:
                        wrong.append(
                            f"{name}: checkpoint {list(shape)}, config implies {list(shapes[ours])}"
                        )
                        continue
                    if mine[name] is None:
                        continue  # an expert another rank holds (expert parallelism)
                    # The MoE router stays fp32 (routing is computed in fp32).
                    want = torch.float32 if model.keeps_fp32(ours) else dtype
                    value = f.get_tensor(name) if tp is None else slicer(f, name, ours, tcfg, tp)
                    state[mine[name]] = value.to(device=device, dtype=want)
                    bar.update(value.numel() * item)
    if wrong:
        raise ModelLoadError(
            f"tensor shapes in {path} do not match config.json: " + "; ".join(wrong)
        )
    absent = sorted(n for n, ours in mine.items() if ours is not None and ours not in state)
    if absent:
        raise ModelLoadError(f"tensors listed in the index but absent from their shard: {absent}")
    local.load_state_dict(state, strict=True, assign=True)
    local.requires_grad_(False)
    if tp is not None:
        local.set_tensor_parallel(tp)
    return local.eval()


def load_model(
    name_or_path: str,
    device: str = "cpu",
    dtype: str = "auto",
    *,
    revision: str | None = None,
    shard: TPShard | None = None,
) -> LoadedModel:
    """Load a checkpoint by embedded name, directory or cached HF id onto ``device`` in ``dtype``
    (with ``shard``: only this tensor-parallel rank's slices, ``models/sharding.py``).

    Raises :class:`ModelLoadError` (bad/missing files, too little memory) or
    ``UnsupportedModelError`` (an architecture this server does not implement).
    """
    path = resolve_model_path(name_or_path, revision)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"no config.json in {path}")
    config = read_json(path / "config.json")
    gen_path = path / "generation_config.json"
    gen = read_json(gen_path) if gen_path.is_file() else {}
    family = family_for(config)
    try:
        tcfg = family.transformer_config(config)
    except UnsupportedModelError:
        raise  # already one line naming the key (a ValueError too)
    except (ValueError, TypeError, ZeroDivisionError) as e:
        # A value of the wrong type or shape (n_heads that does not divide d_model, a string
        # rope_theta, ...): one line naming the file, not a traceback from the arithmetic.
        raise ModelLoadError(f"{path / 'config.json'}: {e}") from None
    dev = _resolve_device(device)
    dt = _resolve_dtype(dtype, dev, config)
    tokenizer = load_tokenizer(path, family)
    try:
        ids = special_ids(dict(family.id_config(config)), gen, tokenizer, family, tcfg.vocab_size)
    except ModelLoadError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    try:
        edit_token_ids = family.edit_tokens(config, tcfg.vocab_size, ids["mask_id"])
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"{path}: {e}") from None
    # A tensor-parallel rank needs memory for its shard only (and an unshardable model is
    # refused here, before any weight is read).
    local = tcfg if shard is None else shard_config(tcfg, shard.size, 0, shard.expert_parallel)
    nbytes = check_memory(local, dt, dev)
    logger.info("loading %s (%s, %.2f GiB) from %s", family.name, dt, nbytes / 2**30, path)
    model = _load_weights(path, family, config, tcfg, dev, dt, shard)
    is_named = name_or_path in EMBEDDED_MODELS or not Path(name_or_path).expanduser().is_dir()
    return LoadedModel(
        # Embedded names and HF ids are what users typed; a directory is named by its last part.
        name=name_or_path if is_named else path.resolve().name,
        path=path,
        model=model,
        tokenizer=tokenizer,
        family=family,
        max_length=tcfg.max_sequence_length,
        device=dev,
        dtype=dt,
        config=config,
        default_gen_length=default_gen_length(gen, gen_path),
        default_block_length=positive_int(gen, "block_length", gen_path)
        or default_gen_length(gen, gen_path),
        mask_lookahead=non_negative_int(gen, "mask_lookahead", gen_path),
        vocab_size=tcfg.vocab_size,
        block_size=family.block_size(config, positive_int(gen, "block_length", gen_path)),
        generation=gen,
        edit_token_ids=edit_token_ids,
        **ids,
    )
