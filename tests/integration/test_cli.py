"""The `dllm-serve` command: --help, and --model PATH serving a local LLaDA checkpoint."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import openai
import pytest
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
