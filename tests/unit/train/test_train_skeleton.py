"""The demo skeleton: the tiny checkpoint of the real format, without its remote-code
entries (the tiny test checkpoints keep them: they reproduce the releases)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dllm_serve_train.skeleton import REMOTE_CODE_KEYS, sizes, with_tool_template, write_skeleton
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
        dropped = (*REMOTE_CODE_KEYS, "chat_template")  # the template: the tests below
        assert {k: v for k, v in demo[name].items() if k != "chat_template"} == {
            k: v for k, v in data.items() if k not in dropped
        }


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


ASSETS = Path(__file__).parents[3] / "src" / "dllm_serve" / "assets"
DEMOS = {"llada": "demo-llada", "idlm": "demo-idlm", "nemotron": "demo-trimode"}
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "Be concise."}, {"role": "user", "content": " hi "}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     {"role": "user", "content": "Reverse the word hello."}],
]  # fmt: skip
GET_SUM = {"type": "function", "function": {"name": "get_sum", "description": "Add.",
           "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}  # fmt: skip


def _template(directory: Path) -> str:
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    return json.loads((directory / "tokenizer_config.json").read_text())["chat_template"]


@pytest.mark.parametrize("family", sorted(DEMOS))
def test_demo_template_renders_tools_and_nothing_else_changes(tmp_path: Path, family: str) -> None:
    """The demos' template: without tools the format's prompt byte for byte (what the demo
    was trained on); with tools the hermes instructions in the system turn, an earlier call
    as a <tool_call> block and the tool's result as a <tool_response>. The shipped demos
    carry exactly the template the skeleton writes."""
    from transformers import AutoTokenizer

    fmt = write_tiny(family, tmp_path / "format", seed=0, **sizes(family, 0, 0, 0))
    demo = tmp_path / "demo"
    write_skeleton(family, demo, 0, 32, sizes(family, 0, 0, 0), 0)
    assert _template(ASSETS / DEMOS[family]) == _template(demo)
    before, after = (AutoTokenizer.from_pretrained(str(d)) for d in (fmt, demo))
    for conversation in CONVERSATIONS:
        for opening in (True, False):
            kwargs = {"tokenize": False, "add_generation_prompt": opening}
            old = before.apply_chat_template(conversation, **kwargs)
            assert after.apply_chat_template(conversation, **kwargs) == old
    call = {"id": "c1", "type": "function", "function": {"name": "get_sum", "arguments": {"a": 2}}}
    trip = [{"role": "system", "content": "Be concise."},
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "4", "tool_call_id": "c1"}]  # fmt: skip
    text = after.apply_chat_template(
        trip, tools=[GET_SUM], tokenize=False, add_generation_prompt=True
    )
    assert text.count("Be concise.") == 1 and text.index("Be concise.") < text.index("# Tools")
    assert '<tools>\n{"type": "function", "function": {"name": "get_sum"' in text
    assert '<tool_call>\n{"name": "get_sum", "arguments": {"a": 2}}\n</tool_call>' in text
    assert text.index("</tool_call>", text.index("What is 2 + 2?")) < text.index(
        "<tool_response>\n4\n</tool_response>"
    )


def test_with_tool_template_keeps_the_other_tokenizer_config_fields(tmp_path: Path) -> None:
    out = write_tiny("llada", tmp_path / "llada", seed=0, **sizes("llada", 0, 0, 0))
    before = json.loads((out / "tokenizer_config.json").read_text())
    with_tool_template(out, "llada")
    after = json.loads((out / "tokenizer_config.json").read_text())
    assert after.pop("chat_template").endswith(before.pop("chat_template") + "{% endif %}")
    assert after == before
