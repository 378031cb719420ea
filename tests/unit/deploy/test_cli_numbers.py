"""Numeric CLI flags refuse nan and inf (found by QA: they passed every range check)."""

from __future__ import annotations

import pytest

from dllm_serve.cli import parse_config
from dllm_serve.config import EngineConfig


@pytest.mark.parametrize("flag", ["--request-timeout", "--shutdown-timeout", "--kv-cache-memory"])
@pytest.mark.parametrize(
    ("value", "message"),
    [("nan", "a finite number"), ("inf", "a finite number"), ("x", "a number")],
)
def test_numeric_flags_refuse_what_is_not_a_finite_number(
    flag: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_config([flag, value])
    assert exit_info.value.code == 2
    assert f"argument {flag}: must be {message}" in capsys.readouterr().err


def test_finite_values_still_parse() -> None:
    config = parse_config(["--request-timeout", "2.5", "--kv-cache-memory", "0.5"])
    assert config.request_timeout == 2.5 and config.engine.kv_cache_memory == 0.5


def test_the_engine_config_refuses_an_infinite_pool() -> None:
    with pytest.raises(ValueError, match="finite number of GiB"):
        EngineConfig(kv_cache_memory=float("inf"))
