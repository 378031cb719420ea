"""Errors the model layer raises at start-up; each message names the path or key at fault."""

from __future__ import annotations


class ModelLoadError(RuntimeError):
    """A checkpoint could not be found or does not match what its config describes."""


class InsufficientMemoryError(ModelLoadError):
    """The device cannot hold the checkpoint's weights (checked before reading any)."""
