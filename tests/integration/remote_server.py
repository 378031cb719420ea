"""A real `dllm-serve` process on 127.0.0.1 and openai SDK clients for it."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Self

import httpx
import openai

from dllm_serve.local_server import LocalServer, free_port

__all__ = ["RemoteServer", "free_port"]


class RemoteServer(LocalServer):
    """:class:`LocalServer` plus clients configured for tests (no retries, bounded timeouts).

    Servers serve the small random ``tiny-llada`` unless the arguments name a model (the
    suite pins its behaviour; the trained default ``demo-llada`` has tests of its own).
    """

    @classmethod
    def start(cls, args: list[str], log: Path, *, pin_model: bool = True, **kwargs: Any) -> Self:
        if pin_model and "--model" not in args:
            args = ["--model", "tiny-llada", *args]
        return super().start(args, log, **kwargs)

    def client(self, **kwargs: object) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60, **kwargs
        )

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60)
