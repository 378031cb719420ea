"""Reading the Kubernetes manifests in tests: YAML documents, objects by kind, a flag's value.

Not collected by pytest (no ``test_`` prefix); shared by the deploy tests.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml


def yaml_docs(path: Path) -> list[dict[str, Any]]:
    """The non-empty YAML documents of ``path`` (at least one)."""
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs, f"{path} holds no YAML document"
    return docs


def objects_by_kind(paths: Iterable[Path]) -> dict[str, dict[str, Any]]:
    """kind -> object over the documents of ``paths`` (one object of each kind)."""
    objects: dict[str, dict[str, Any]] = {}
    for path in paths:
        for doc in yaml_docs(path):
            assert doc["kind"] not in objects, f"second {doc['kind']} in {path.name}"
            objects[doc["kind"]] = doc
    return objects


def flag_value(args: list[str], flag: str) -> str:
    """The value after the last ``flag`` in ``args`` (argparse: the last one wins)."""
    return args[len(args) - 1 - args[::-1].index(flag) + 1]
