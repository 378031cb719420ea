"""--api-key / DLLM_API_KEY: a key no HTTP client can send is refused at start-up (found by
QA: a non-ASCII key could only be matched by latin-1 bytes, which httpx and the openai SDK
refuse to send), and an empty one means no key."""

from __future__ import annotations

import pytest

from dllm_serve.cli import parse_config


@pytest.mark.parametrize("key", ["clé-ñ", " key", "key ", "tab\tkey", "line\nkey"])
def test_a_key_a_header_cannot_carry_is_refused(
    key: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--api-key", key])
    assert exit_info.value.code == 2
    assert "--api-key (or DLLM_API_KEY) must be visible ASCII" in capsys.readouterr().err


def test_the_environment_variable_is_checked_too(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DLLM_API_KEY", "clé")
    with pytest.raises(SystemExit):
        parse_config([])
    assert "must be visible ASCII" in capsys.readouterr().err


@pytest.mark.parametrize("key", ["sk-local-123", "a b", "!~"])
def test_visible_ascii_keys_are_kept(key: str) -> None:
    assert parse_config(["--api-key", key]).api_key == key


def test_an_empty_key_means_no_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DLLM_API_KEY", "")
    assert parse_config([]).api_key is None
    assert parse_config(["--api-key", ""]).api_key is None
