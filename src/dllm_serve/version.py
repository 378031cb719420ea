"""The package's version, as ``/version`` and ``--version`` report it (``pyproject.toml``
states it too; a test holds the two equal)."""

__version__ = "0.1.0"
