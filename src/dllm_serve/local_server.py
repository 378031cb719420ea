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

# Starts of a child that lost its port to another process between free_port() and its bind.
PORT_ATTEMPTS = 3


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def listens(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` holds a TCP socket listening on ``port`` (None: this system
    has no Linux ``/proc`` to tell)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            # local address (hex ip:port), state (0A: LISTEN), inode
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:[") and target[8:-1] in inodes:
            return True
    return False


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
        """Start with CLI ``args``; raise with the log if it exits or is not healthy in time.

        The free port is free when chosen, not when the child binds it seconds later: another
        process (a server another test started at the same time) may take it in between. So
        the server counts as up only once it is *this* child that listens there (a healthy
        answer could come from the other one), and a child that exits because the port was
        taken is started again on another port."""
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        deadline = time.monotonic() + timeout
        for attempt in range(1, PORT_ATTEMPTS + 1):
            port = free_port()
            cmd = [sys.executable, "-m", "dllm_serve", "--host", "127.0.0.1", "--port", str(port)]
            with log.open("wb") as out:
                proc = subprocess.Popen(
                    [*cmd, *args], stdout=out, stderr=subprocess.STDOUT, env=full_env
                )
            server = cls(proc, port, log)
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    text = log.read_text()
                    if f"port {port} on 127.0.0.1 is in use" in text and attempt < PORT_ATTEMPTS:
                        break
                    raise RuntimeError(f"server exited with {proc.returncode}:\n{text}")
                if server.healthy() and listens(proc.pid, port) is not False:
                    return server
                time.sleep(0.25)
            else:
                server.stop()
                raise RuntimeError(f"server did not become healthy:\n{log.read_text()}")
        raise AssertionError("unreachable: the last attempt returns or raises")

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
