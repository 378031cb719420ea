"""The deviations table served at /docs is the one pinned in README.md, and
docs/api-contract.md (the contract it summarizes) covers every field in it."""

import re
from pathlib import Path

from dllm_serve.api.deviations import DEVIATIONS_TABLE

ROOT = Path(__file__).resolve().parents[3]
CONTRACT = ROOT / "docs" / "api-contract.md"


def test_readme_pins_the_deviations_table_after_the_quick_start() -> None:
    """A new reader meets the commands first; the table (also at /docs) comes after them."""
    readme = (ROOT / "README.md").read_text()
    assert DEVIATIONS_TABLE in readme
    sections = [line for line in readme.splitlines() if line.startswith("## ")]
    assert sections[:2] == ["## Quick start in two commands", "## Use it"]
    assert readme.index("## Quick start") < readme.index(DEVIATIONS_TABLE)


def test_readme_quick_start_installs_the_cpu_torch_before_the_package() -> None:
    """Pasted as it stands, the quick start's block never pulls the multi-GB CUDA torch: the
    CPU build is installed first, in the block, with the GPU variant beside it."""
    readme = (ROOT / "README.md").read_text()
    quick = readme[readme.index("## Quick start") :]
    start = quick.index("```bash\n") + len("```bash\n")
    block = quick[start : quick.index("\n```", start)]
    commands = [line.split("#")[0].strip() for line in block.splitlines()]
    assert commands == [
        "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu "
        "&& pip install -e .",
        "dllm-serve",
    ]
    assert "# GPU: pip install torch && pip install -e ." in block
    use = readme[readme.index("## Use it") : readme.index("## ", readme.index("## Use it") + 3)]
    for needed in (
        "curl -s http://127.0.0.1:8000/v1/chat/completions",
        "from openai import",
        "http://127.0.0.1:8000/",
        "docker run --gpus all",
    ):
        assert needed in use, needed


def test_the_deviations_table_has_one_short_line_per_row() -> None:
    """The table is a summary: every rule's details live in docs/api-contract.md."""
    rows = [line for line in DEVIATIONS_TABLE.splitlines() if line.startswith("| ")][1:]
    assert len(rows) == 33
    for row in rows:
        semantics = row.split(" | ")[-1]
        assert len(semantics) <= 130, row


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
