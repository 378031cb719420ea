"""Fixtures for the integration tests: one shared server for the session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from remote_server import RemoteServer


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    srv = RemoteServer.start(["--log-level", "warning"], log)
    yield srv
    srv.stop()
