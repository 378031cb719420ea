"""The shipped demo checkpoints: real formats, size limit, model cards, default canvas, and
held-out answers at the server's default settings (temperature 0)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dllm_serve.llm import LLM
from dllm_serve.models.hub import EMBEDDED_MODELS
from dllm_serve.models.loader import load_model
from dllm_serve.train.tasks import TASKS, held_out_set

FAMILIES = {"demo-llada": "llada", "demo-idlm": "sdar"}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_demo_checkpoint_format_size_and_card(name: str) -> None:
    path = Path(EMBEDDED_MODELS[name])
    assert (path / "model.safetensors").stat().st_size <= 20_000_000
    loaded = load_model(name, device="cpu", dtype="float32")
    assert loaded.family.name == FAMILIES[name]
    assert loaded.default_gen_length == 32
    card = (path / "README.md").read_text()
    report = json.loads((path / "training_report.json").read_text())
    assert card.startswith(f"# {name}\n")
    assert report["command"] in card
    for task in TASKS:  # every held-out score of the report is in the card's table
        assert f"| {task} | {report['held_out_exact_match'][task] * 100:.1f}% |" in card


def test_llm_default_model_is_demo_llada() -> None:
    with LLM() as llm:
        assert llm.loaded.name == "demo-llada"
        assert llm.engine.default_gen_length == 32


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_demo_answers_held_out_additions_at_default_settings(name: str) -> None:
    card = json.loads((Path(EMBEDDED_MODELS[name]) / "training_report.json").read_text())
    exs = held_out_set(40, task="addition")
    with LLM(name, device="cpu", dtype="float32") as llm:
        outs = llm.generate([[{"role": "user", "content": e.question}] for e in exs])
    right = sum(o.text == e.answer for o, e in zip(outs, exs, strict=True))
    # The first 40 of the card's 1,000 held-out additions: within 10 points of its score.
    assert right / len(exs) >= card["held_out_exact_match"]["addition"] - 0.10
    # Whatever the sum, every answer has the trained format with both operands copied.
    for o, e in zip(outs, exs, strict=True):
        assert re.fullmatch(re.escape(e.answer.split("=")[0]) + r"= \d{1,4}", o.text), o.text
