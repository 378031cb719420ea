"""A tri-mode (Nemotron-Labs-Diffusion-format) checkpoint served by a real dllm-serve on
127.0.0.1, through the openai SDK (max_retries=0): ``linear_spec`` (the default, with the
draft LoRA loaded) answers exactly what ``ar`` answers at T = 0, streamed and not; the
``diffusion`` mode answers too; ``decoding_mode`` values a model does not have are 400s."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from remote_server import RemoteServer

from dllm_serve.decoding.params import DecodingParams
from dllm_serve.llm import LLM
from dllm_serve_train.tiny_checkpoints import write_tiny_nemotron

QUESTIONS = ["What is 2 + 2?", "Reverse the word cat."]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = Path(tmp_path_factory.mktemp("nemotron"))
    path = write_tiny_nemotron(root / "tiny-nemotron", block_size=8, seed=1,
                               draft_lora_out=root / "lora")  # fmt: skip
    return path, root / "lora"


def test_linear_spec_answers_what_ar_answers(checkpoint: tuple[Path, Path], tmp_path: Path) -> None:
    path, lora = checkpoint
    params = DecodingParams(gen_length=12, steps=12, decoding_mode="ar")
    with LLM(str(path), device="cpu", dtype="float32") as llm:
        want = [c.text for c in llm.generate([[{"role": "user", "content": q}] for q in QUESTIONS],
                                             params)]  # fmt: skip
    server = RemoteServer.start(
        ["--model", str(path), "--draft-lora", str(lora), "--log-level", "warning"],
        tmp_path / "log",
    )
    try:
        client = server.client()
        for question, text in zip(QUESTIONS, want, strict=True):
            messages = [{"role": "user", "content": question}]
            ar = client.chat.completions.create(
                model="m", messages=messages, max_tokens=12, extra_body={"decoding_mode": "ar"}
            )
            spec = client.chat.completions.create(model="m", messages=messages, max_tokens=12)
            assert ar.choices[0].message.content == spec.choices[0].message.content == text
            usage = spec.model_dump()["usage"]["diffusion"]
            assert usage["drafted_tokens"] > 0 and usage["nfe"] > 1
            chunks = client.chat.completions.create(
                model="m", messages=messages, max_tokens=12, stream=True
            )
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
            diffusion = client.chat.completions.create(
                model="m", messages=messages, max_tokens=16,
                extra_body={"decoding_mode": "diffusion", "confidence_threshold": 0.5},
            )  # fmt: skip
            assert diffusion.choices[0].finish_reason in ("stop", "length")
            assert "drafted_tokens" not in diffusion.model_dump()["usage"]["diffusion"]
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model="m", messages=messages, extra_body={"decoding_mode": "isd"}
            )
        assert info.value.body["param"] == "decoding_mode"
        assert "decodes by 'ar', 'diffusion' or 'linear_spec'" in info.value.body["message"]
    finally:
        server.stop()


def test_a_single_mode_model_names_its_mode(server: RemoteServer) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"decoding_mode": "linear_spec"},
        )
    assert info.value.status_code == 400
    assert info.value.body == {
        "message": "'decoding_mode' 'linear_spec' is not available for this model: it decodes "
        "only by 'diffusion' (diffusion: masked positions denoised in parallel). Omit "
        "'decoding_mode' or set it to 'diffusion'.",
        "type": "invalid_request_error",
        "param": "decoding_mode",
        "code": "not_applicable",
    }


def test_decoding_mode_flag_must_be_the_models_own(tmp_path: Path) -> None:
    """A single-mode model refuses a --decoding-mode it does not have, at start-up."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "dllm_serve", "--model", "tiny-llada", "--decoding-mode", "ar",
         "--port", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    assert "--decoding-mode ar: model 'tiny-llada' decodes only by 'diffusion'" in result.stderr
