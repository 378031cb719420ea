"""Hooks through which the engine reports what it does (metrics live in api/metrics.py).

The engine calls these on its own thread; implementations must be cheap and thread-safe.
"""

from __future__ import annotations

from typing import Protocol

from dllm_serve.engine.outputs import RequestOutput


class EngineObserver(Protocol):
    def on_forward(self, rows: int, tokens: int, model_seconds: float) -> None: ...

    def on_iteration(self, busy_seconds: float) -> None: ...

    def on_first_content(self, seconds_since_arrival: float) -> None: ...

    def on_finished(self, output: RequestOutput, seconds_since_arrival: float) -> None: ...


class NullObserver:
    """The default: observe nothing."""

    def on_forward(self, rows: int, tokens: int, model_seconds: float) -> None:
        pass

    def on_iteration(self, busy_seconds: float) -> None:
        pass

    def on_first_content(self, seconds_since_arrival: float) -> None:
        pass

    def on_finished(self, output: RequestOutput, seconds_since_arrival: float) -> None:
        pass
