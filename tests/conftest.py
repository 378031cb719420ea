"""Settings for every test process.

The suite runs on pytest-xdist workers (``-n auto`` in ``pyproject.toml``): each worker is a
process of its own, and torch would give each one intra-op threads for every core, so two
workers on two cores would run four busy threads. Each worker takes its share of the cores,
and so does every process a test starts (a server, a tensor-parallel rank): tests compare a
server's tokens with the in-process engine's, and a different thread count sums in a different
order, which can flip a near-tie of a tiny random model's logits.
"""

from __future__ import annotations

import os

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        threads = max(1, torch.get_num_threads() // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)
