"""A device fault in a real server: every in-flight request gets an error, ``/health`` turns
503, and the process exits with status 1 so that Docker or Kubernetes restarts it.

The fault is injected into a real ``python -m dllm_serve`` process by a ``sitecustomize``
module on its ``PYTHONPATH`` (test code only): from the third forward on, the ModelRunner
raises the error a CUDA context gives after an illegal memory access.
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import httpx
from remote_server import RemoteServer

INJECT = """
import torch
from dllm_serve.engine import model_runner

_run = model_runner.ModelRunner.run
_calls = [0]


def run(self, rows):
    _calls[0] += 1
    if _calls[0] >= 3:
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
    return _run(self, rows)


model_runner.ModelRunner.run = run
"""


def test_device_fault_fails_every_request_turns_health_503_and_exits_1(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(INJECT)
    server = RemoteServer.start(
        ["--log-level", "warning"], tmp_path / "server.log", env={"PYTHONPATH": str(tmp_path)}
    )
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
        with (
            httpx.Client(base_url=server.url, timeout=60) as client,
            concurrent.futures.ThreadPoolExecutor(3) as pool,
        ):
            futures = [
                pool.submit(client.post, "/v1/chat/completions", json=body) for _ in range(3)
            ]
            answers = [f.result() for f in futures]
            for answer in answers:
                assert answer.status_code in (500, 503), answer.text
                assert answer.json()["error"]["type"] in (
                    "server_error",
                    "service_unavailable_error",
                )
            assert client.get("/health").status_code == 503
        assert server.process.wait(timeout=30) == 1
        log = (tmp_path / "server.log").read_text()
        assert "device fault, the engine stops" in log
        assert "exiting with status 1" in log
    finally:
        server.stop()
