"""Per-request decoding parameters (torch-free, so the API layer can build them)."""

from __future__ import annotations

from dataclasses import dataclass

BLOCK_SCHEDULES = ("uniform", "front_loaded", "cosine")
CONFIDENCE_METRICS = ("top1_prob", "entropy_inverse")


@dataclass(frozen=True, slots=True)
class DecodingParams:
    """How one request is denoised.

    The canvas of ``gen_length`` masked positions is split into ``gen_length // block_length``
    blocks decoded left to right (LLaDA's semi-autoregressive sampling); each block gets
    ``steps // num_blocks`` denoising steps. ``temperature == 0`` is greedy (argmax);
    otherwise tokens are drawn by Gumbel-max in float64 from a generator seeded with ``seed``.
    """

    gen_length: int = 128
    steps: int = 128
    block_length: int | None = None  # None: one block covering the whole canvas
    temperature: float = 0.0
    seed: int | None = None
    block_schedule: str = "uniform"
    confidence_metric: str = "top1_prob"
    force_single_batch: bool = False

    def __post_init__(self) -> None:
        if self.gen_length < 1:
            raise ValueError("gen_length must be >= 1")
        if self.block_length is None:
            object.__setattr__(self, "block_length", self.gen_length)
        if self.steps < 1:
            raise ValueError("steps must be >= 1")
        if not 1 <= self.block_length <= self.gen_length:
            raise ValueError("block_length must be in [1, gen_length]")
        if self.gen_length % self.block_length:
            raise ValueError("block_length must divide gen_length")
        if self.steps % self.num_blocks:
            raise ValueError("the number of blocks must divide steps")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError("temperature must be in [0, 2]")
        if self.block_schedule not in BLOCK_SCHEDULES:
            raise ValueError(f"block_schedule must be one of {BLOCK_SCHEDULES}")
        if self.confidence_metric not in CONFIDENCE_METRICS:
            raise ValueError(f"confidence_metric must be one of {CONFIDENCE_METRICS}")

    @property
    def num_blocks(self) -> int:
        assert self.block_length is not None  # resolved in __post_init__
        return self.gen_length // self.block_length

    @property
    def steps_per_block(self) -> int:
        return self.steps // self.num_blocks
