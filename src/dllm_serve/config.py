"""Frozen configuration objects, one per layer, built by the CLI from its flags."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model: str = "tiny-llada"  # embedded model name or a local checkpoint directory
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_running_requests: int = 16  # requests denoised concurrently (steps interleaved)


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
