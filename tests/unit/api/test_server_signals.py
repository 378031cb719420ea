"""DrainingServer's signal counting: drain, then abort now, then exit at once.

The first two are exercised end to end on a real server (tests/reliability/test_rel_sigterm.py);
two signals sent back to back there can merge into one, so the third is tested here.
"""

from __future__ import annotations

import asyncio
import signal

import pytest
import uvicorn
from sse_starlette.sse import AppStatus

from dllm_serve.api import server as server_module
from dllm_serve.api.server import DrainingServer


class Exited(Exception):
    pass


@pytest.fixture(autouse=True)
def _restore_sse_status(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop sets sse-starlette's process-wide flag, which would end later tests' streams."""
    monkeypatch.setattr(AppStatus, "should_exit", False)


def test_signals_drain_then_hurry_then_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    drained: list[bool] = []
    exits: list[int] = []

    def fake_exit(status: int) -> None:
        exits.append(status)
        raise Exited

    monkeypatch.setattr(server_module.os, "_exit", fake_exit)
    server = DrainingServer(uvicorn.Config(app=None), engine=None, lifecycle=None, timeout=60)  # type: ignore[arg-type]

    async def fake_drain() -> None:
        drained.append(True)

    monkeypatch.setattr(server, "_drain", fake_drain)

    async def scenario() -> None:
        server._loop = asyncio.get_running_loop()
        server.handle_exit(signal.SIGTERM, None)
        await asyncio.sleep(0.01)
        assert drained == [True] and not server._hurry.is_set() and exits == []
        server.handle_exit(signal.SIGTERM, None)
        await asyncio.sleep(0.01)
        assert server._hurry.is_set() and drained == [True] and exits == []
        with pytest.raises(Exited):
            server.handle_exit(signal.SIGTERM, None)
        assert exits == [1]

    asyncio.run(scenario())
    assert not server.force_exit  # never uvicorn's force exit (it skips the engine's shutdown)


def test_a_signal_before_the_server_runs_just_stops_it() -> None:
    server = DrainingServer(uvicorn.Config(app=None), engine=None, lifecycle=None, timeout=60)  # type: ignore[arg-type]
    server.handle_exit(signal.SIGINT, None)
    assert server.should_exit and not server.force_exit
