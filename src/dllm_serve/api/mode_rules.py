"""Which request fields apply to the model's decoding mode, and which modes a request may
name (``decoding_mode``; ``decoding/modes.py``). Every mismatch is a 400 that names the mode."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dllm_serve.api.errors import invalid
from dllm_serve.decoding.modes import DESCRIPTIONS, DIFFUSION, TRI_MODE, TRI_MODES, model_mode

# What a request's canvas fields (num_denoising_steps, block_length) mean, by how it decodes.
CANVAS = "canvas"  # LLaDA, Dream: one canvas of max_tokens, in blocks the request may choose
BLOCK = "block"  # block diffusion: the trained block, aligned to position 0; steps per block
NO_CANVAS = "none"  # self-speculation, ar, linear_spec: no denoising steps or blocks


@dataclass(frozen=True, slots=True)
class ModelDecoding:
    """What the served model's decoding lets a request choose (read once from the engine).

    ``kind`` is the engine's algorithm kind (``diffusion``, ``block_diffusion``,
    ``self_speculation`` or ``tri_mode``), ``block_size`` a block model's trained block and
    ``default_mode`` a tri-mode model's mode for requests that name none.
    """

    kind: str
    block_size: int | None = None
    default_mode: str | None = None

    def canvas_rules(self, requested: str | None) -> str:
        """:data:`CANVAS`, :data:`BLOCK` or :data:`NO_CANVAS` for a request naming
        ``requested`` as its ``decoding_mode`` (None: the model's default)."""
        if self.kind == "diffusion":
            return CANVAS
        if self.kind == "block_diffusion":
            return BLOCK
        if self.kind == TRI_MODE and (requested or self.default_mode) == DIFFUSION:
            return BLOCK
        return NO_CANVAS

    def self_speculative(self, requested: str | None) -> bool:
        """Whether a request naming ``requested`` decodes by self-speculation (I-DLM's ISD, a
        tri-mode model's ``ar`` or ``linear_spec``): its usage carries the draft counters."""
        if self.kind == "self_speculation":
            return True
        return self.kind == TRI_MODE and (requested or self.default_mode) != DIFFUSION


def check_decoding_mode(
    requested: str | None,
    block_length: int | None,
    diffusion_fields: Sequence[str],
    model: ModelDecoding,
) -> None:
    """``requested`` and ``block_length`` are the request's ``decoding_mode`` and
    ``block_length`` (None: not set), ``diffusion_fields`` the denoising fields it set."""
    kind, block_size, default_mode = model.kind, model.block_size, model.default_mode
    if kind == TRI_MODE:
        mode = requested or default_mode or ""
        if mode not in TRI_MODES:
            raise invalid(
                f"'decoding_mode' '{mode}' is not available for this model: it is a tri-mode "
                "model and decodes by 'ar', 'diffusion' or 'linear_spec'. Omit "
                f"'decoding_mode' to use the server's default ('{default_mode}').",
                "decoding_mode",
                code="not_applicable",
            )
        if mode == DIFFUSION:
            _check_block(block_length, diffusion_fields, block_size, "its diffusion mode decodes")
        elif diffusion_fields:
            name = diffusion_fields[0]
            raise invalid(
                f"'{name}' configures diffusion denoising, but this request decodes by "
                f"'{mode}' ({DESCRIPTIONS[mode]}): it has no denoising steps, blocks, schedules "
                "or commit thresholds. Omit it, or set 'decoding_mode': 'diffusion'.",
                name,
                code="not_applicable",
            )
        return
    own = model_mode(kind)
    if requested is not None and requested != own:
        raise invalid(
            f"'decoding_mode' '{requested}' is not available for this model: it decodes only "
            f"by '{own}' ({DESCRIPTIONS[own]}). Omit 'decoding_mode' or set it to '{own}'.",
            "decoding_mode",
            code="not_applicable",
        )
    if kind == "block_diffusion":
        _check_block(block_length, diffusion_fields, block_size, "it is a block-diffusion model")
    if kind == "self_speculation" and diffusion_fields:
        name = diffusion_fields[0]
        raise invalid(
            f"'{name}' configures diffusion denoising, but this model decodes by exact "
            "self-speculation (I-DLM): it has no denoising steps, blocks, schedules or commit "
            "thresholds. Omit it; max_tokens, temperature, seed and stop apply.",
            name,
            code="not_applicable",
        )


def _check_block(
    block_length: int | None, fields: Sequence[str], block_size: int | None, what: str
) -> None:
    """Block-diffusion decoding runs in the checkpoint's trained block: another one is a 400."""
    if "block_length" in fields and block_length != block_size:
        raise invalid(
            f"'block_length' must be {block_size} for this model: {what} in the block it was "
            "trained with (bidirectional inside a block, causal across blocks), and other "
            "blocks are not what it learned. Omit it.",
            "block_length",
            code="not_applicable",
        )
