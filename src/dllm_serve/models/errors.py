"""Errors of the model layer: what it raises at start-up (each message names the path or key
at fault), and the device faults that end serving."""

from __future__ import annotations

import torch


class ModelLoadError(RuntimeError):
    """A checkpoint could not be found or does not match what its config describes."""


class InsufficientMemoryError(ModelLoadError):
    """The device cannot hold the checkpoint's weights (checked before reading any)."""


class ChatTemplateError(ValueError):
    """A conversation the checkpoint's chat template cannot render: it has no template, or the
    template refuses these messages (roles out of order, ...). A request error, not a crash."""


class DeviceFault(RuntimeError):
    """The device failed in a way that leaves it unusable (a CUDA error is sticky: every later
    kernel on that context fails too). The engine stops; the server exits so that its
    orchestrator restarts it."""


def is_device_fault(exc: BaseException) -> bool:
    """Whether ``exc`` leaves the device unusable: an accelerator error (an illegal memory
    access, a device-side assert, a lost device). Out-of-memory is not: it fails the rows of
    one forward and the next forward may fit."""
    fault = getattr(torch, "AcceleratorError", None)  # torch >= 2.8
    return isinstance(exc, DeviceFault) or (fault is not None and isinstance(exc, fault))
