"""The :class:`Family` contract and helpers shared by the per-family modules."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dllm_serve.models.rope import RopeConfigError
from dllm_serve.models.transformer import TransformerConfig


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is not one this server implements."""


@dataclass(frozen=True)
class Family(ABC):
    """Rules shared by every checkpoint of one model family.

    Fields the decoding layer and engine read:

    - ``bidirectional``: True = every token attends to every other (LLaDA, Dream); False =
      strictly causal (I-DLM), which also makes a KV prefix cache exact.
    - ``logit_shift``: True = the distribution for position ``j`` is read from the output at
      ``j - 1`` (Dream, I-DLM: an AR-style next-token head; Dream's own sampler lets position 0
      reuse its own output).
    - ``mask_token`` / ``eot_token`` / ``extra_stop_tokens``: token *strings*; the loader looks
      their ids up in the checkpoint (config first, tokenizer second), never in constants.

    Subclasses implement :meth:`check`, :meth:`transformer_config` and :meth:`weight_map`.
    """

    name: str
    bidirectional: bool
    logit_shift: bool
    mask_token: str
    eot_token: str | None
    model_types: tuple[str, ...]  # lower-case config.json model_type values
    architectures: tuple[str, ...]  # config.json "architectures" entries
    description: str
    extra_stop_tokens: tuple[str, ...] = ()
    # Used instead of the class named in tokenizer_config.json when that class exists only as
    # the checkpoint's remote code (Dream's DreamTokenizer is a plain Qwen2 BPE).
    tokenizer_class: str | None = None
    # Buffers some exports save next to the weights; they hold nothing this model needs.
    ignored_tensor_suffixes: tuple[str, ...] = (".rotary_emb.inv_freq",)
    # Block diffusion (SDAR, LLaDA2): attention is block-causal — bidirectional inside a block of
    # :meth:`block_size` tokens, causal across blocks — so finished blocks' K/V are exact and a
    # decode step forwards only the active block.
    block_diffusion: bool = False
    # Tri-mode (Nemotron-Labs-Diffusion): one set of weights decoded causally (AR), by block
    # diffusion over a causal prefix, or by LinearSpec self-speculation, chosen per request.
    tri_mode: bool = False
    # LLaDA2.1 token editing: the checkpoints were trained to rewrite unmasked tokens of the
    # open block, so requests may ask for JointThreshold (edit_threshold). Other families' T2T
    # would rewrite tokens by a distribution never trained for it.
    token_editing: bool = False

    @property
    def attention(self) -> str:
        """``"bidirectional"`` or ``"causal"`` (the names of ``decoding.AttentionKind``)."""
        return "bidirectional" if self.bidirectional else "causal"

    def matches(self, config: Mapping[str, Any]) -> bool:
        """Whether ``config.json`` names this family: by ``model_type`` when it has one (a
        contradicting ``architectures`` entry does not override it), else by architecture."""
        model_type = config.get("model_type")
        if model_type:
            return str(model_type).lower() in self.model_types
        return any(a in self.architectures for a in config.get("architectures") or [])

    @abstractmethod
    def check(self, config: Mapping[str, Any]) -> None:
        """Raise :class:`UnsupportedModelError` unless this server implements ``config``."""

    @abstractmethod
    def transformer_config(self, config: Mapping[str, Any]) -> TransformerConfig:
        """The :class:`TransformerConfig` described by a checkpoint's ``config.json``."""

    @abstractmethod
    def weight_map(self, tcfg: TransformerConfig) -> dict[str, str]:
        """Every tensor name the checkpoint must contain -> its name in ``DecoderTransformer``."""

    def ignorable_tensor(self, name: str, tcfg: TransformerConfig) -> bool:
        """Tensors some exports carry that hold nothing this model needs (e.g. RoPE buffers)."""
        return name.endswith(self.ignored_tensor_suffixes)

    def with_tensors(
        self, config: Mapping[str, Any], tcfg: TransformerConfig, names: set[str]
    ) -> TransformerConfig:
        """``tcfg`` adjusted to the tensor names the checkpoint holds, for switches its config
        does not state reliably (LLaDA2's q/k norms); unchanged by default."""
        return tcfg

    def id_config(self, config: Mapping[str, Any]) -> Mapping[str, Any]:
        """The keys the special ids (eos, pad, bos, mask) are read from: ``config.json`` itself
        by default (DiffusionGemma nests them in ``text_config``)."""
        return config

    def edit_tokens(
        self, config: Mapping[str, Any], vocab_size: int, mask_id: int
    ) -> tuple[int, int] | None:
        """The ``(DELETE, SPLIT)`` edit-token ids of an insert/delete editing checkpoint
        (LLaDA2.2), checked against the vocabulary and the mask id; None for every other."""
        return None

    def block_size(self, config: Mapping[str, Any], block_length: int | None) -> int | None:
        """The trained block of a block-diffusion checkpoint (None for other families), from
        ``config.json`` and ``generation_config.json``'s ``block_length``."""
        return int(config["block_size"]) if self.block_diffusion else None


def require(config: Mapping[str, Any], key: str) -> Any:
    """``config[key]``, or an :class:`UnsupportedModelError` naming the missing key."""
    if config.get(key) is None:
        raise UnsupportedModelError(f"config.json lacks required key {key!r}")
    return config[key]


def positive_int(label: str, config: Mapping[str, Any], key: str, *, zero_ok: bool = False) -> int:
    """``config[key]`` as a positive (or, with ``zero_ok``, non-negative) integer, else an
    :class:`UnsupportedModelError` naming the key; ``label`` names the format ("LLaDA2")."""
    value = require(config, key)
    low = 0 if zero_ok else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        bound = "a non-negative" if zero_ok else "a positive"
        raise UnsupportedModelError(
            f"{label} config.json: {key} must be {bound} integer, got {value!r}"
        )
    return value


def check_values(
    family: str, config: Mapping[str, Any], expected: tuple[tuple[str, Any], ...]
) -> None:
    """Refuse keys present with a value other than the one this server implements."""
    for key, want in expected:
        if key in config and config[key] is not None and config[key] != want:
            raise UnsupportedModelError(
                f"{family} config has {key}={config[key]!r}; only {key}={want!r} is supported"
            )


def rope_error(exc: RopeConfigError) -> UnsupportedModelError:
    return UnsupportedModelError(f"config.json: {exc}")
