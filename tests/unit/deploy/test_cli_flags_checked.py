"""Flags are checked when they are parsed, and their errors name them (found by QA: --port
99999 failed with a traceback after the model loaded, an empty --host listened on every
interface, CORS origins that can never match were accepted, the engine's errors named its
fields, not the flags)."""

from __future__ import annotations

import pytest

from dllm_serve.cli import flag_names, parse_config


def refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse_config(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "99999"], "argument --port: must be 0-65535, got 99999"),
        (["--port", "-1"], "argument --port: must be >= 0, got -1"),
        (["--host", ""], "--host must not be empty"),
        (["--host", " "], "--host must not be empty"),
        (["--max-running-requests", "0"], "--max-running-requests must be >= 1"),
        (["--max-tokens-per-forward", "0"], "--max-tokens-per-forward must be >= 1"),
        (["--max-waiting-requests", "-1"], "--max-waiting-requests must be >= 0"),
        (["--isd-stride", "0"], "--isd-stride must be >= 1"),
        (["--kv-cache-memory", "0"], "--kv-cache-memory must be a finite number of GiB > 0"),
        (["--cors-origins", "app.example.com"], "--cors-origins: 'app.example.com' is not an"),
        (["--cors-origins", "https://a.example/"], "--cors-origins: 'https://a.example/' is"),
        (["--cors-origins", "https://a.example/app"], "'https://a.example/app' is not an"),
        (["--cors-origins", "http://*.example.com"], "'http://*.example.com' is not an"),
        (["--cors-origins", "https://App.example.com"], "'https://App.example.com' is not an"),
        (["--cors-origins", "https://a.example:abc"], "'https://a.example:abc' is not an"),
    ],
)
def test_a_bad_flag_is_refused_by_name(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert message in refusal(argv, capsys)


def test_good_values_parse() -> None:
    origins = [
        "https://app.example.com",
        "http://localhost:5173",
        "http://[::1]:8080",
        "https://xn--bcher-kva.example",
        "chrome-extension://abcdef",
        "null",  # file:// pages and sandboxed frames send it
        "*",
    ]
    argv = ["--port", "0", "--host", " 0.0.0.0 ", "--cors-origins", ", ".join(origins)]
    config = parse_config(argv)
    assert config.port == 0 and config.host == "0.0.0.0"  # padding stripped, not bound as is
    assert config.cors_origins == tuple(origins)
    assert parse_config(["--port", "65535"]).port == 65535


def test_only_engine_fields_become_flags() -> None:
    assert flag_names("isd_stride must be >= 1") == "--isd-stride must be >= 1"
    assert flag_names("block_length and other_words stay") == "block_length and other_words stay"
