"""The demo skeleton: the tiny checkpoint of the real format, without its remote-code
entries (the tiny test checkpoints keep them: they reproduce the releases)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dllm_serve_train.skeleton import REMOTE_CODE_KEYS, sizes, write_skeleton
from dllm_serve_train.tiny_checkpoints import write_tiny

FILES = ("config.json", "tokenizer_config.json")


def _read(path: Path) -> dict[str, dict]:
    return {f: json.loads((path / f).read_text()) for f in FILES if (path / f).is_file()}


@pytest.mark.parametrize("family", ["llada", "idlm", "nemotron"])
def test_demo_skeleton_drops_only_the_remote_code_entries(tmp_path: Path, family: str) -> None:
    size = sizes(family, 0, 0, 0)
    tiny = _read(write_tiny(family, tmp_path / "tiny", seed=0, **size))
    assert "auto_map" in tiny["config.json"]  # the release's files, as the tiny writers keep them
    out = tmp_path / "demo"
    write_skeleton(family, out, 0, 32, size, 0)
    demo = _read(out)
    assert demo.keys() == tiny.keys()
    for name, data in tiny.items():
        assert demo[name] == {k: v for k, v in data.items() if k not in REMOTE_CODE_KEYS}


def test_transformers_loads_a_demo_skeletons_tokenizer_without_asking(tmp_path: Path) -> None:
    """What guidellm, aiperf or evalscope do with --tokenizer <demo dir>: with an auto_map
    transformers stops at "Do you wish to run the custom code? [y/N]"."""
    dirs = []
    for family in ("llada", "idlm", "nemotron"):
        dirs.append(tmp_path / family)
        write_skeleton(family, dirs[-1], 0, 32, sizes(family, 0, 0, 0), 0)
    code = (
        "import sys\nfrom transformers import AutoTokenizer\n"
        "for d in sys.argv[1:]:\n"
        "    print(len(AutoTokenizer.from_pretrained(d)('hello')['input_ids']))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, *map(str, dirs)],
        capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "custom code" not in run.stdout + run.stderr
    assert len(run.stdout.split()) == 3  # one token count per tokenizer loaded
