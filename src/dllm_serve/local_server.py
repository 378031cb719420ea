"""A ``python -m dllm_serve`` child process on a free 127.0.0.1 port, polled until healthy.

Used by the integration and reliability tests and by the serving benchmark, so all of them
start the server exactly the way a user does (the real CLI, the real uvicorn).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Self


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class LocalServer:
    """The child process, its port and its log file (stdout and stderr)."""

    process: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @classmethod
    def start(
        cls,
        args: list[str],
        log: Path,
        env: dict[str, str] | None = None,
        timeout: float = 120,
    ) -> Self:
        """Start with CLI ``args``; raise with the log if it exits or is not healthy in time."""
        port = free_port()
        cmd = [sys.executable, "-m", "dllm_serve", "--host", "127.0.0.1", "--port", str(port)]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [*cmd, *args], stdout=out, stderr=subprocess.STDOUT, env=full_env
            )
        server = cls(proc, port, log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
            if server.healthy():
                return server
            time.sleep(0.25)
        server.stop()
        raise RuntimeError(f"server did not become healthy:\n{log.read_text()}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=1) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, grace: float = 15) -> None:
        """SIGTERM (the server drains and exits 0), then SIGKILL after ``grace`` seconds."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
