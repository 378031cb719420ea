"""The deviations table served at /docs is the one pinned in README.md (ADR 005)."""

from pathlib import Path

from dllm_serve.api.deviations import DEVIATIONS_TABLE

ROOT = Path(__file__).resolve().parents[3]


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
