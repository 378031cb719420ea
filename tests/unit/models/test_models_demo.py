"""The shipped demo checkpoints: real formats, size limit, model cards, default canvas, and
held-out answers at the server's default settings (temperature 0)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dllm_serve.decoding.params import DecodingParams
from dllm_serve.llm import LLM
from dllm_serve.models.hub import EMBEDDED_MODELS
from dllm_serve.models.loader import load_model
from dllm_serve_train.__main__ import server_params
from dllm_serve_train.tasks import STRATA, held_out_additions, held_out_set

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
    scores = report["held_out_exact_match"]
    canvases = sorted({int(k.rsplit("@", 1)[1]) for k in scores}, key=int)  # those evaluated
    assert 32 in canvases
    for name in report["held_out_counts"]:  # every held-out score of the report is in the card
        row = " | ".join(f"{scores[f'{name}@{c}'] * 100:.1f}%" for c in canvases)
        assert f" | {row} | {report['held_out_counts'][name]} |" in card, name


def test_llm_default_model_is_demo_llada() -> None:
    with LLM() as llm:
        assert llm.loaded.name == "demo-llada"
        assert llm.engine.default_gen_length == 32


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_demo_answers_held_out_questions_at_default_settings(name: str) -> None:
    report = json.loads((Path(EMBEDDED_MODELS[name]) / "training_report.json").read_text())
    scores = report["held_out_exact_match"]
    sets = {f"addition_{s}": held_out_additions(s, 12) for s in STRATA}
    sets["reverse_word"] = held_out_set(12, task="reverse_word")
    with LLM(name, device="cpu", dtype="float32") as llm:
        for key, exs in sets.items():
            outs = llm.generate([[{"role": "user", "content": e.question}] for e in exs])
            right = sum(o.text == e.answer for o, e in zip(outs, exs, strict=True))
            # A dozen of the card's held-out questions: within 15 points of its score.
            assert right / len(exs) >= scores[f"{key}@32"] - 0.15, (key, [o.text for o in outs])
            if key.startswith("addition"):  # every answer has the format, operands copied
                for o, e in zip(outs, exs, strict=True):
                    assert re.fullmatch(re.escape(e.answer.split("=")[0]) + r"= \d{1,4}", o.text)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_demo_answers_do_not_depend_on_max_tokens(name: str) -> None:
    """What a person types first, at the canvases people send out of habit."""
    questions = ["What is 2 + 2?", "What is 15 + 27?", "What is 123 + 456?"]
    messages = [[{"role": "user", "content": q}] for q in questions]
    with LLM(name, device="cpu", dtype="float32") as llm:
        answers = {
            length: [o.text for o in llm.generate(messages, server_params(length))]
            for length in (16, 32, 256, 1024)
        }
    assert answers[32] == ["2 + 2 = 4", "15 + 27 = 42", "123 + 456 = 579"]
    assert answers[16] == answers[256] == answers[1024] == answers[32]
    assert server_params(1024) == DecodingParams(gen_length=1024, steps=1024, block_length=32)


def test_demo_trimode_checkpoint_adapter_card_and_exactness() -> None:
    """The tri-mode demo: Nemotron format, its PEFT draft LoRA loads by name, the card shows
    every mode's measured row, and LinearSpec answered every held-out question as ar did."""
    from dllm_serve.models.lora import attach_draft_lora
    from dllm_serve_train.trimode_card import mode_table

    path = Path(EMBEDDED_MODELS["demo-trimode"])
    assert (path / "model.safetensors").stat().st_size <= 20_000_000
    loaded = load_model("demo-trimode", device="cpu", dtype="float32")
    assert loaded.family.name == "nemotron" and loaded.family.tri_mode
    assert attach_draft_lora(loaded.model, "demo-trimode-lora") == loaded.model.config.n_layers
    report = json.loads((path / "training_report.json").read_text())
    by_mode = report["held_out_by_mode"]
    card = (path / "README.md").read_text()
    assert card.startswith("# demo-trimode\n") and report["command"] in card
    assert mode_table(by_mode) in card
    for mode in ("linear_spec", "linear_spec+lora"):
        assert by_mode[mode]["same_answers_as_ar"] == by_mode["questions"]
