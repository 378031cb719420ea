"""The `dllm-serve` command: --help, --model PATH serving a local checkpoint, the start-up log,
and a busy port refused before the model loads."""

from __future__ import annotations

import http.server
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
from remote_server import RemoteServer
from safetensors import safe_open

import dllm_serve
from dllm_serve import local_server


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
    assert proc.stderr.strip() == (
        f"dllm-serve: model {str(missing)!r}: directory {missing} does not exist. Pass a "
        "checkpoint directory (config.json, tokenizer files, *.safetensors), a model id already "
        "in the Hugging Face cache, or an embedded model. Embedded models: demo-idlm, "
        "demo-llada, demo-trimode, tiny-llada"
    )


def test_corrupt_weights_fail_with_one_line_and_no_traceback(tmp_path: Path) -> None:
    ckpt = tmp_path / "cut"
    subprocess.run(
        [sys.executable, "-m", "dllm_serve", "make-tiny", str(ckpt), "--n-layers", "1"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    weights = ckpt / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # the header intact, half the tensors gone
    proc = subprocess.run(
        [sys.executable, "-m", "dllm_serve", "--model", str(ckpt), "--log-level", "warning"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        f"dllm-serve: cannot load model {str(ckpt)!r}: cannot read {weights}: not a valid "
        "safetensors file, truncated or corrupt (Error while deserializing header: incomplete "
        "metadata, file not fully covered); copy or download it again"
    )


@pytest.mark.parametrize("family", ["llada", "dream", "idlm"])
def test_serves_local_checkpoint_of_each_family(tmp_path: Path, family: str) -> None:
    ckpt = tmp_path / f"my-{family}"
    subprocess.run(
        [sys.executable, "-m", "dllm_serve", "make-tiny", "--family", family, str(ckpt)],
        check=True,
        timeout=120,
    )
    assert (ckpt / "config.json").exists()
    server = RemoteServer.start(["--model", str(ckpt), "--log-level", "warning"], tmp_path / "log")
    try:
        client = server.client()
        assert [m.id for m in client.models.list().data] == [f"my-{family}"]
        messages = [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello"},
        ]
        out = client.chat.completions.create(model="x", messages=messages, max_tokens=16)
        assert out.model == f"my-{family}"
        assert out.choices[0].finish_reason in ("stop", "length")
        assert out.usage.completion_tokens <= 16
        text, chunks = (
            "",
            list(
                client.chat.completions.create(
                    model="x", messages=messages, max_tokens=16, stream=True
                )
            ),
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == out.choices[0].message.content
        diffusion = out.usage.model_extra["diffusion"]
        if family == "idlm":  # exact self-speculation: denoising fields do not apply
            assert diffusion["drafted_tokens"] >= diffusion["accepted_drafts"] >= 0
            with pytest.raises(openai.BadRequestError) as info:
                client.chat.completions.create(
                    model="x", messages=messages, extra_body={"block_length": 8}
                )
            assert info.value.body["param"] == "block_length"
            assert info.value.body["code"] == "not_applicable"
        else:
            assert diffusion.get("drafted_tokens") is None
    finally:
        server.stop()


def _log_line(log: str, logger: str) -> list[str]:
    """The messages ``logger`` wrote, without the text format's time and level prefix."""
    marker = f"] {logger}: "
    return [line.split(marker, 1)[1] for line in log.splitlines() if marker in line]


def test_start_up_log_then_a_second_server_on_its_port_exits_before_loading(
    tmp_path: Path,
) -> None:
    server = RemoteServer.start(["--model", "tiny-llada"], tmp_path / "log")
    try:
        lines = _log_line(server.log.read_text(), "dllm_serve")
        url = f"http://127.0.0.1:{server.port}"
        assert len(lines) == 4, lines
        assert re.fullmatch(r"loaded tiny-llada in \d+\.\d s \(cpu, torch\.float32\)", lines[0])
        assert lines[1] == (
            "no KV pool: tiny-llada's decoding keeps no K/V (LLaDA and Dream keep one with "
            "--kv-cache prefix)"
        )
        assert re.fullmatch(r"engine ready in \d+\.\d s", lines[2])
        ready = (
            f"serving tiny-llada on 127.0.0.1:{server.port}: playground {url}/ · API {url}/v1 · "
            f"docs {url}/docs (ready "
        )
        assert re.fullmatch(re.escape(ready) + r"\d+\.\d s after start\)", lines[3])

        # The same port again, with the default (trained) model: refused before it loads.
        started = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "dllm_serve", "--host", "127.0.0.1", "--port", str(server.port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        took = time.monotonic() - started
    finally:
        server.stop()
    assert proc.returncode == 1
    # One line and nothing else: the loader's "loading llada ..." line never came.
    assert proc.stderr == (
        f"dllm-serve: port {server.port} on 127.0.0.1 is in use (another dllm-serve, or another "
        "server, listens there); stop it or choose another --port\n"
    )
    assert proc.stdout == ""
    assert took < 30  # importing torch, not loading a model (a 8B checkpoint takes minutes)


def test_start_up_log_names_the_draft_lora_and_the_kv_pool_it_took(tmp_path: Path) -> None:
    """``--kv-cache-memory 100000`` is a ceiling: the log says what the pool took."""
    args = ["--model", "demo-trimode", "--draft-lora", "demo-trimode-lora"]
    args += ["--kv-cache-memory", "100000", "--max-running-requests", "2"]
    server = RemoteServer.start(args, tmp_path / "log")
    try:
        lines = _log_line(server.log.read_text(), "dllm_serve")
    finally:
        server.stop()
    asset = Path(dllm_serve.__file__).parent / "assets" / "demo-trimode"
    config = json.loads((asset / "config.json").read_text())
    with safe_open(asset / "draft-lora" / "adapter_model.safetensors", "pt") as adapter:
        layers = {key.split(".layers.")[1].split(".")[0] for key in adapter.keys()}  # noqa: SIM118
    # A slot is one token's K and V in every layer (float32 on CPU); a request's worst case
    # is the longest context plus LinearSpec's block (docs/configuration.md).
    per_slot = 2 * config["num_hidden_layers"] * config["num_key_value_heads"]
    per_slot *= config["head_dim"] * 4
    longest = config["max_position_embeddings"] + config["block_size"]
    longest = -(-longest // 16) * 16  # whole pages of 16 tokens
    assert lines[1] == (
        f"draft LoRA demo-trimode-lora: o_proj of {len(layers)} layer(s) adapted, used by "
        "LinearSpec's draft forwards only"
    )
    assert lines[2] == (
        f"KV pool: {2 * longest * per_slot / 2**30:.3g} GiB, {2 * longest:,} tokens in "
        f"{2 * longest // 16:,} pages of 16 (--kv-cache-memory asked for 100000 GiB; capped "
        "at what --max-running-requests 2 "
        f"requests of the longest context, {longest:,} tokens each, can use)"
    )


class _Healthy(http.server.BaseHTTPRequestHandler):
    """Answers 200 to anything: another process's server on the port."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_a_test_server_that_loses_its_port_starts_again_on_another(tmp_path: Path) -> None:
    """free_port() frees the port it found before the child binds it, and a server another
    test starts at that moment can take it. The helper must not take that server's /health
    for its own child's, and starts the child again on another port."""
    other = http.server.HTTPServer(("127.0.0.1", 0), _Healthy)
    taken = other.server_address[1]
    threading.Thread(target=other.serve_forever, daemon=True).start()
    real = local_server.free_port
    ports = iter([taken])
    mp = pytest.MonkeyPatch()
    mp.setattr(local_server, "free_port", lambda: next(ports, None) or real())
    try:
        server = RemoteServer.start(["--log-level", "warning"], tmp_path / "log")
    finally:
        mp.undo()
        other.shutdown()
        other.server_close()
    try:
        assert server.port != taken
        assert local_server.listens(server.process.pid, server.port) is True
        assert server.client().models.list().data[0].id == "tiny-llada"
    finally:
        server.stop()
    # listens() tells a listening socket of a process from a bound, silent one.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        assert local_server.listens(os.getpid(), port) is False
        sock.listen()
        assert local_server.listens(os.getpid(), port) is True
