"""Rotary position embeddings: parsing a checkpoint's RoPE settings and computing the tables.

Layout is NeoX/HF-Llama ``rotate_half`` (halves, not interleaved), frequencies always in fp32.
The scaled variants follow transformers 5.x ``modeling_rope_utils`` (the reference the parity
tests compare against): ``linear``, ``dynamic`` (only inside the original context, where it
equals the default), ``llama3`` and ``yarn``. Any other type is refused: a RoPE variant computed
the wrong way gives fluent-looking garbage, which is worse than a start-up error.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


class RopeConfigError(ValueError):
    """The checkpoint asks for a RoPE variant this module does not compute."""


@dataclass(frozen=True)
class RopeScaling:
    """A non-default RoPE variant and its parameters (names as in transformers' configs)."""

    rope_type: str
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn; derived from factor/mscale when None
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn


def _rope_dict(config: Mapping[str, Any]) -> dict[str, Any]:
    """The one RoPE parameter dict of a 4.x (``rope_scaling``) or 5.x (``rope_parameters``)
    config; 5.x may nest it per layer type, which is accepted only when all layers agree."""
    raw = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if not isinstance(raw, Mapping):
        raise RopeConfigError(f"rope parameters must be a JSON object, got {raw!r}")
    # Nested per layer type ({"full_attention": {...}, ...}), whether or not the config lists
    # its layer_types: a flat dict's values are numbers, strings or lists, never objects.
    nested = [v for v in raw.values() if isinstance(v, Mapping)]
    if nested and len(nested) != len(raw):
        raise RopeConfigError(f"rope parameters mix per-layer and flat entries ({raw!r})")
    if nested:
        if any(dict(v) != dict(nested[0]) for v in nested):
            raise RopeConfigError(f"per-layer RoPE parameters differ ({raw!r}); not supported")
        raw = nested[0]
    return dict(raw)


def partial_rotary_factor(config: Mapping[str, Any]) -> float:
    """The fraction of each head's dims that rotate (``partial_rotary_factor``, at the top
    level or inside the RoPE parameters; 1.0 when absent)."""
    params = _rope_dict(config)
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if partial is None:
        return 1.0
    if isinstance(partial, bool) or not isinstance(partial, int | float) or not 0 < partial <= 1:
        raise RopeConfigError(f"partial_rotary_factor must be in (0, 1], got {partial!r}")
    return float(partial)


def parse_rope(
    config: Mapping[str, Any],
    max_position_embeddings: int,
    default_theta: float = 10000.0,
    *,
    allow_partial: bool = False,
) -> tuple[float, RopeScaling | None]:
    """``(theta, scaling)`` from a config.json written by transformers 4.x or 5.x.

    A ``partial_rotary_factor`` below 1 is refused unless the caller builds partial RoPE
    (``allow_partial``; it reads the factor with :func:`partial_rotary_factor`).
    """
    params = _rope_dict(config)
    theta = params.get("rope_theta", config.get("rope_theta"))
    theta = float(default_theta if theta is None else theta)
    partial = partial_rotary_factor(config)
    if partial != 1.0 and not allow_partial:
        raise RopeConfigError(f"partial_rotary_factor={partial} is not supported (only 1.0)")
    # 4.x wrote "type", 5.x writes "rope_type" (and sometimes both).
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        supported = ", ".join(SUPPORTED_ROPE_TYPES)
        raise RopeConfigError(f"RoPE type {rope_type!r} is not supported; supported: {supported}")
    if rope_type == "default":
        return theta, None

    def need(key: str) -> Any:
        if params.get(key) is None:
            raise RopeConfigError(f"RoPE type {rope_type!r} needs {key!r} in its parameters")
        return params[key]

    if rope_type in ("linear", "dynamic"):
        return theta, RopeScaling(rope_type, factor=float(need("factor")))
    original = int(params.get("original_max_position_embeddings") or max_position_embeddings)
    if rope_type == "llama3":
        return theta, RopeScaling(
            "llama3",
            factor=float(need("factor")),
            original_max_position_embeddings=original,
            low_freq_factor=float(need("low_freq_factor")),
            high_freq_factor=float(need("high_freq_factor")),
        )
    factor = params.get("factor")
    return theta, RopeScaling(
        "yarn",
        # transformers 5.x: no factor means "max_position_embeddings over the original".
        factor=float(factor) if factor is not None else max_position_embeddings / original,
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=params.get("attention_factor"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
    )


def _yarn(inv_freq: torch.Tensor, dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    """Blend interpolated (low-frequency) and extrapolated (high-frequency) dimensions."""
    assert s.original_max_position_embeddings is not None

    def correction_dim(rotations: float) -> float:
        ctx = s.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(ctx) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    index = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((index - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    return (inv_freq / s.factor) * (1 - extrapolate) + inv_freq * extrapolate


def _yarn_attention_factor(s: RopeScaling) -> float:
    if s.attention_factor is not None:
        return float(s.attention_factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.mscale and s.mscale_all_dim:
        return mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim)
    return mscale(s.factor)


def rope_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None
) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim/2] fp32, attention_factor)``; cos/sin are scaled by the factor."""
    # Always on the CPU: the loader builds modules under ``torch.device("meta")``.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    # "dynamic" only rescales beyond max_position_embeddings, which is also the context limit
    # this server enforces, so inside it the default frequencies are exact.
    if scaling is None or scaling.rope_type == "dynamic":
        return inv_freq, 1.0
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor, 1.0
    if scaling.rope_type == "llama3":
        assert scaling.low_freq_factor is not None and scaling.high_freq_factor is not None
        old = scaling.original_max_position_embeddings
        assert old is not None
        low_wavelen, high_wavelen = old / scaling.low_freq_factor, old / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    return _yarn(inv_freq, head_dim, theta, scaling), _yarn_attention_factor(scaling)


def rotary_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [B, 1, L, head_dim] in fp32 for integer ``positions`` [B, L]."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # halves layout, not interleaved
    cos, sin = emb.cos(), emb.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos, sin


def rotary_table(
    length: int, inv_freq: torch.Tensor, attention_factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and *signed* sin ``[length, head_dim]`` (fp32) for positions ``0..length-1``.

    Row ``p`` holds exactly what :func:`rotary_tables` computes for position ``p``, except that
    the first half of sin is negated: :func:`apply_rotary` then needs no ``rotate_half``
    negation, only a roll (``x·cos + roll(x)·sin_signed``).
    """
    cos, sin = rotary_tables(torch.arange(length)[None], inv_freq, attention_factor)
    cos, sin = cos[0, 0], sin[0, 0]
    half = sin.shape[-1] // 2
    return cos.contiguous(), torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[..., hd]`` in fp32 and return it in its own dtype.

    ``rotate_half(x) = cat(-x2, x1)`` equals ``roll(x, hd/2) * [-1…, 1…]``; the sign lives in
    ``sin_signed`` (:func:`rotary_table`), so this is a roll, a multiply and a fused
    multiply-add.
    """
    x32 = x.float()
    rolled = x32.roll(x32.shape[-1] // 2, dims=-1)
    return torch.addcmul(x32 * cos, rolled, sin_signed).to(x.dtype)


@dataclass(frozen=True)
class QueryScale:
    """Llama-4 style position-dependent query scaling (Ministral3, Nemotron-Labs-Diffusion).

    After RoPE every query is multiplied by ``1 + beta · log(1 + ⌊p / length⌋)`` for its
    rotary position ``p`` (transformers ``get_llama_4_attn_scale``): exactly 1 inside the
    original context (``p < length``), then a slowly growing temperature that keeps attention
    from flattening over a YaRN-extended context. Keys are not scaled.
    """

    beta: float
    length: int  # rope_parameters.original_max_position_embeddings

    def factors(self, positions: torch.Tensor) -> torch.Tensor:
        """fp32 factors with ``positions``' shape."""
        blocks = torch.floor(positions.to(torch.float32) / self.length)
        return 1.0 + self.beta * torch.log(1.0 + blocks)


def parse_query_scale(config: Mapping[str, Any]) -> QueryScale | None:
    """The :class:`QueryScale` of a config whose RoPE parameters carry
    ``llama_4_scaling_beta`` (None when absent or 0: every factor would be 1)."""
    params = _rope_dict(config)
    beta = params.get("llama_4_scaling_beta")
    if beta is None or float(beta) == 0.0:
        return None
    length = params.get("original_max_position_embeddings")
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise RopeConfigError(
            "llama_4_scaling_beta needs a positive integer original_max_position_embeddings "
            f"in the RoPE parameters, got {length!r}"
        )
    return QueryScale(float(beta), length)
