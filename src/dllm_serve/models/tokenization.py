"""Tokenizer loading without remote code, and the special ids a checkpoint uses.

transformers' ``AutoTokenizer`` reads every format the supported checkpoints ship:
``tokenizer.json`` (LLaDA), ``vocab.json`` + ``merges.txt`` (Dream, Qwen), the chat template
inside ``tokenizer_config.json`` (4.x) or in ``chat_template.jinja`` (5.x). Only the class
name can be a problem: Dream's ``tokenizer_config.json`` names ``DreamTokenizer``, which exists
only as remote code; it is a plain Qwen2 BPE, so the family's ``tokenizer_class`` is used.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from dllm_serve.models.errors import ModelLoadError
from dllm_serve.models.families import Family

logger = logging.getLogger(__name__)

# Files any one of which makes a directory hold a tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "vocab.txt")


def _tokenizer_config(path: Path) -> dict[str, Any]:
    file = path / "tokenizer_config.json"
    if not file.is_file():
        return {}
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {file}: {e}") from e


def load_tokenizer(path: Path, family: Family) -> Any:
    """The checkpoint's tokenizer, loaded offline and without remote code."""
    import transformers  # heavy import, only needed here

    present = [f for f in _TOKENIZER_FILES if (path / f).is_file()]
    if not present:
        raise ModelLoadError(
            f"no tokenizer in {path}: expected one of {', '.join(_TOKENIZER_FILES)} "
            "(with tokenizer_config.json)"
        )
    tok_cfg = _tokenizer_config(path)
    name = tok_cfg.get("tokenizer_class")
    remote = bool((tok_cfg.get("auto_map") or {}).get("AutoTokenizer"))
    native = not isinstance(name, str) or hasattr(transformers, name)
    kwargs: dict[str, Any] = {"local_files_only": True}
    try:
        if not native and family.tokenizer_class is not None:
            logger.info("tokenizer class %s is not in transformers; loading as %s",
                        name, family.tokenizer_class)  # fmt: skip
            cls = getattr(transformers, family.tokenizer_class)
            tokenizer = cls.from_pretrained(str(path), **kwargs)
        elif not native and remote:
            raise ModelLoadError(
                f"{path}/tokenizer_config.json names tokenizer class {name!r}, which exists "
                "only as the checkpoint's remote code; dllm-serve never runs remote code"
            )
        else:
            # An empty config stops AutoTokenizer from parsing config.json as a transformers
            # model config (model_type "llada" is unknown to it, and it would look for remote
            # code); the class then comes from tokenizer_config.json alone.
            tokenizer = transformers.AutoTokenizer.from_pretrained(
                str(path), config=transformers.PreTrainedConfig(), trust_remote_code=False, **kwargs
            )
    except ModelLoadError:
        raise
    except Exception as e:  # transformers raises many types; all mean "unusable tokenizer"
        raise ModelLoadError(f"cannot load the tokenizer in {path}: {e}") from e
    if not getattr(tokenizer, "chat_template", None):
        logger.warning("%s has no chat template; chat requests will be refused", path)
    return tokenizer


def _first(*values: Any) -> int | None:
    """The first value that is not None (a list counts by its first element)."""
    for value in values:
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return None


def _all_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def token_id(tokenizer: Any, token: str | None) -> int | None:
    """The id of an exact token string, or None (never the unk id)."""
    if token is None:
        return None
    return tokenizer.get_vocab().get(token)


def special_ids(
    config: dict[str, Any], gen: dict[str, Any], tokenizer: Any, family: Family, vocab: int
) -> dict[str, Any]:
    """mask/eos/eot/bos/pad/stop ids, from config.json first, then generation_config, then
    the tokenizer; never from constants, since every checkpoint family numbers them its own way.

    Stop ids: every EOS id of config and generation config, the family's end-of-turn token
    and its extra stop tokens (I-DLM also stops at ``<|endoftext|>``).
    """
    mask_from_tok = token_id(tokenizer, family.mask_token)
    mask_id = _first(config.get("mask_token_id"), mask_from_tok)
    eos_id = _first(config.get("eos_token_id"), gen.get("eos_token_id"), tokenizer.eos_token_id)
    if mask_id is None or eos_id is None:
        raise ModelLoadError(
            f"cannot determine the mask id ({family.mask_token!r}) or the EOS id "
            "from config.json, generation_config.json or the tokenizer"
        )
    if mask_from_tok is not None and mask_from_tok != mask_id:
        logger.warning(
            "config mask_token_id %d differs from the tokenizer's %s (%d); using the config's",
            mask_id, family.mask_token, mask_from_tok,
        )  # fmt: skip
    eot_id = token_id(tokenizer, family.eot_token)
    ids = {
        "mask_id": mask_id,
        "eos_id": eos_id,
        "eot_id": eot_id,
        "bos_id": _first(
            gen.get("bos_token_id"), config.get("bos_token_id"), tokenizer.bos_token_id
        ),
        "pad_id": _first(
            config.get("pad_token_id"), gen.get("pad_token_id"), tokenizer.pad_token_id
        ),
    }
    bad = {k: v for k, v in ids.items() if v is not None and not 0 <= v < vocab}
    if bad:
        raise ModelLoadError(f"special ids {bad} lie outside the {vocab}-row vocabulary")
    if mask_id == ids["pad_id"]:
        raise ModelLoadError(f"the mask id {mask_id} equals the pad id")
    stops = {eos_id, *_all_ids(config.get("eos_token_id")), *_all_ids(gen.get("eos_token_id"))}
    for token in (family.eot_token, *family.extra_stop_tokens):
        tid = token_id(tokenizer, token)
        if tid is not None:
            stops.add(tid)
    if mask_id in stops:
        raise ModelLoadError(f"the mask id {mask_id} is also a stop id")
    return {**ids, "stop_ids": tuple(sorted(stops))}
