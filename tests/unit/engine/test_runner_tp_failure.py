"""A tensor-parallel step that fails stops the server visibly; an out-of-memory error is
named as such (found by a code review: it was logged as a failed collective, which sent
operators looking for a network fault)."""

from __future__ import annotations

import logging

import pytest
import torch

from dllm_serve.engine import model_runner
from dllm_serve.engine.model_runner import ModelRunner


class Exited(Exception):
    pass


def _exit(code: int) -> None:
    raise Exited(code)


@pytest.mark.parametrize(
    ("exc", "logged"),
    [
        (torch.OutOfMemoryError("CUDA out of memory"), "tensor-parallel step ran out of memory"),
        (RuntimeError("Connection reset by peer"), "tensor-parallel collective failed"),
    ],
)
def test_a_failed_step_names_what_failed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, exc: Exception, logged: str
) -> None:
    runner = ModelRunner.__new__(ModelRunner)
    runner.parallel = None
    monkeypatch.setattr(model_runner.os, "_exit", _exit)
    with caplog.at_level(logging.CRITICAL), pytest.raises(Exited):
        runner._collective_failed(exc)
    assert f"{logged}: {exc}; exiting" in caplog.text
