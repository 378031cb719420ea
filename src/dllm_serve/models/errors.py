"""Errors the model layer raises at start-up; each message names the path or key at fault."""

from __future__ import annotations


class ModelLoadError(RuntimeError):
    """A checkpoint could not be found or does not match what its config describes."""


class InsufficientMemoryError(ModelLoadError):
    """The device cannot hold the checkpoint's weights (checked before reading any)."""


class ChatTemplateError(ValueError):
    """A conversation the checkpoint's chat template cannot render: it has no template, or the
    template refuses these messages (roles out of order, ...). A request error, not a crash."""
