"""The `dllm-serve` command: --help, and --model PATH serving a local LLaDA checkpoint."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from remote_server import RemoteServer


def test_help_lists_every_flag() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "dllm_serve", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for flag in ("--model", "--host", "--port", "--device", "--dtype", "--max-running-requests"):
        assert flag in out
    assert "make-tiny" in out


def test_unknown_model_fails_fast_with_message(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    proc = subprocess.run(
        [sys.executable, "-m", "dllm_serve", "--model", str(missing)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert str(missing) in proc.stderr


def test_serves_local_checkpoint_directory(tmp_path: Path) -> None:
    ckpt = tmp_path / "my-llada"
    subprocess.run(
        [sys.executable, "-m", "dllm_serve", "make-tiny", str(ckpt)], check=True, timeout=120
    )
    assert (ckpt / "config.json").exists()
    server = RemoteServer.start(["--model", str(ckpt), "--log-level", "warning"], tmp_path / "log")
    try:
        client = server.client()
        assert [m.id for m in client.models.list().data] == ["my-llada"]
        out = client.chat.completions.create(
            model="my-llada", messages=[{"role": "user", "content": "hello"}], max_tokens=16
        )
        assert out.model == "my-llada"
        assert out.choices[0].finish_reason in ("stop", "length")
    finally:
        server.stop()
