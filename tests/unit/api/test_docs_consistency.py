"""The deviations table served at /docs is the one pinned in README.md, and
docs/api-contract.md (the contract it summarizes) covers every field in it."""

import re
from pathlib import Path

from dllm_serve.api.deviations import DEVIATIONS_TABLE

ROOT = Path(__file__).resolve().parents[3]
CONTRACT = ROOT / "docs" / "api-contract.md"


def test_readme_pins_the_deviations_table_near_the_top() -> None:
    readme = (ROOT / "README.md").read_text()
    assert DEVIATIONS_TABLE in readme
    assert readme.index(DEVIATIONS_TABLE) < readme.index("## Quick start")


def test_table_mentions_every_extension_field() -> None:
    from dllm_serve.api.protocol import ChatCompletionRequest

    extensions = [
        name
        for name in ChatCompletionRequest.model_fields
        if name.startswith(("num_denoising", "block_", "confidence", "target", "attention_"))
        or name.startswith(("force_single", "use_local", "local_leap"))
    ]
    assert len(extensions) == 12
    for name in extensions:
        assert f"`{name}`" in DEVIATIONS_TABLE, name


def table_fields() -> list[str]:
    """Every `code` span in the first column of the deviations table (fields, routes)."""
    rows = [line for line in DEVIATIONS_TABLE.splitlines() if line.startswith("| ")][1:]
    return [span for row in rows for span in re.findall(r"`([^`]+)`", row.split(" | ")[0][2:])]


def test_api_contract_covers_every_field_of_the_deviations_table() -> None:
    contract = CONTRACT.read_text()
    fields = table_fields()
    assert len(fields) >= 50  # the parse found the table's rows
    missing = [name for name in fields if f"`{name}`" not in contract]
    assert not missing, f"docs/api-contract.md does not mention {missing}"


def test_api_contract_stands_alone() -> None:
    """The contract is written for this repository: it cites no external decision record."""
    assert "ADR" not in CONTRACT.read_text()
    readme = (ROOT / "README.md").read_text()
    assert "docs/api-contract.md" in readme[: readme.index(DEVIATIONS_TABLE)]
