"""Fixtures of the reliability suite: servers on 127.0.0.1 (subprocess or in-process)."""

from __future__ import annotations

import sys
from pathlib import Path

# RemoteServer (a real `python -m dllm_serve` subprocess) lives with the integration tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from collections.abc import Iterator

import pytest
from rel_support import REL_BODY_LIMIT, REL_REQUEST_TIMEOUT_S
from remote_server import RemoteServer


@pytest.fixture(scope="session")
def rel_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    """One server for the input tests (starting one costs ~10 s on 2 cores).

    A valid fuzzed request may ask for a 2000-token canvas (seconds on CPU): the server's own
    deadline bounds it, and a 504 ``request_timeout`` is that documented outcome.
    """
    log = tmp_path_factory.mktemp("rel") / "server.log"
    args = [
        "--max-request-bytes",
        str(REL_BODY_LIMIT),
        "--request-timeout",
        str(REL_REQUEST_TIMEOUT_S),
        "--log-level",
        "warning",
    ]
    server = RemoteServer.start(args, log)
    yield server
    server.stop()
