"""The port is bound before the model loads (serving.bind_port): what it binds, what it
refuses, and the URL the start-up log prints."""

from __future__ import annotations

import socket

import pytest

from dllm_serve.serving import PortUnavailableError, base_url, bind_port


def test_binds_without_listening_until_the_server_starts() -> None:
    [sock] = bind_port("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        assert sock.getsockname() == ("127.0.0.1", port) and port > 0
        # Bound but not listening: a client is refused until the engine is ready.
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
    finally:
        sock.close()


def test_a_port_someone_listens_on_is_one_line() -> None:
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(PortUnavailableError) as info:
            bind_port("127.0.0.1", port)
    assert str(info.value) == (
        f"dllm-serve: port {port} on 127.0.0.1 is in use (another dllm-serve, or another "
        "server, listens there); stop it or choose another --port"
    )


def test_a_host_that_does_not_resolve_is_one_line() -> None:
    with pytest.raises(PortUnavailableError) as info:
        bind_port("no-such-host.invalid", 0)
    assert str(info.value).startswith(
        "dllm-serve: --host 'no-such-host.invalid' is not an address or a known host name ("
    )


def test_every_address_of_a_name_shares_the_port_chosen_for_port_0() -> None:
    sockets = bind_port("localhost", 0)
    try:
        ports = {sock.getsockname()[1] for sock in sockets}
        assert len(ports) == 1 and ports != {0}
    finally:
        for sock in sockets:
            sock.close()


@pytest.mark.parametrize(
    ("host", "url"),
    [
        ("127.0.0.1", "http://127.0.0.1:8000"),
        ("0.0.0.0", "http://127.0.0.1:8000"),
        ("::", "http://[::1]:8000"),
        ("::1", "http://[::1]:8000"),
        ("my-node", "http://my-node:8000"),
    ],
)
def test_the_url_to_open(host: str, url: str) -> None:
    assert base_url(host, 8000) == url
