"""A real `dllm-serve` process on 127.0.0.1 and openai SDK clients for it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

STARTUP_TIMEOUT_S = 90


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class RemoteServer:
    """`python -m dllm_serve` in a subprocess, polled on /health until it answers."""

    process: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, **kwargs: object) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60, **kwargs
        )

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60)

    @classmethod
    def start(cls, args: list[str], log: Path) -> RemoteServer:
        port = free_port()
        cmd = [sys.executable, "-m", "dllm_serve", "--host", "127.0.0.1", "--port", str(port)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with log.open("wb") as out:
            proc = subprocess.Popen([*cmd, *args], stdout=out, stderr=subprocess.STDOUT, env=env)
        server = cls(proc, port, log)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
            try:
                if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                    return server
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        server.stop()
        raise RuntimeError(f"server did not become healthy:\n{log.read_text()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
