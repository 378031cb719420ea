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
from dllm_serve_train.off_topic import CAPABILITY_REPLY
from dllm_serve_train.tasks import STRATA, held_out_additions, held_out_phrasings, held_out_set

FAMILIES = {"demo-llada": "llada", "demo-idlm": "sdar"}


def at_canvases(scores: dict[str, float]) -> dict[str, float]:
    """A report's held-out scores keyed ``task@canvas``: a run without ``--eval-canvases``
    evaluates at its default canvas (32 for the demos) and writes the bare task names."""
    return {k if "@" in k else f"{k}@32": v for k, v in scores.items()}


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
    scores = at_canvases(report["held_out_exact_match"])
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
    scores = at_canvases(report["held_out_exact_match"])
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
    from dllm_serve_train.model_card import mode_table

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


DEMOS = ["demo-idlm", "demo-llada", "demo-trimode"]
# What the issue typed, and what each demo must answer (none of it trained on as such).
TYPED = [
    ("Reverse the word hello.", "olleh"),
    ("Reverse the word hello", "olleh"),
    ("reverse the word hello.", "olleh"),
    ("what is 2 + 2", "2 + 2 = 4"),
    ("Hi", CAPABILITY_REPLY),
    ("Tell me a joke", CAPABILITY_REPLY),
    ("Who are you?", CAPABILITY_REPLY),
]


# Issue 39's bar (docs/training.md): every typed prompt, also after a system prompt or an earlier
# turn, and 10+ of these 12 per held-out set. All three demos meet it; on the cards' 200 held-out
# reversals demo-trimode answers 77.0% (the other two 91.5% and 95.5%).


@pytest.mark.parametrize("name", DEMOS)
def test_demo_understands_how_people_ask(name: str) -> None:
    """The issue's prompts, a dozen held-out phrasings per task (at least 10 of 12 right; the
    cards report each demo's rate on 200), and a system prompt or an earlier turn that change
    nothing."""
    sets = {t: held_out_phrasings(t, 12) for t in ("addition", "reverse_word", "off_topic")}
    with LLM(name, device="cpu", dtype="float32") as llm:
        outs = llm.generate([[{"role": "user", "content": q}] for q, _ in TYPED])
        assert [o.text for o in outs] == [a for _, a in TYPED]
        for task, exs in sets.items():
            outs = llm.generate([e.messages() for e in exs])
            right = sum(o.text == e.answer for o, e in zip(outs, exs, strict=True))
            got = [(e.question, o.text) for o, e in zip(outs, exs, strict=True)]
            assert right >= 10, (task, got)
        system = {"role": "system", "content": "You are a helpful assistant."}
        turn = [{"role": "user", "content": "What is 15 + 27?"},
                {"role": "assistant", "content": "15 + 27 = 42"}]  # fmt: skip
        for question, answer in TYPED:
            asked = {"role": "user", "content": question}
            outs = llm.generate([[system, asked], [*turn, asked], [system, *turn, asked]])
            assert [o.text for o in outs] == [answer] * 3, question


@pytest.mark.parametrize("name", DEMOS)
def test_demo_configs_name_no_remote_code(name: str) -> None:
    path = Path(EMBEDDED_MODELS[name])
    for file in ("config.json", "tokenizer_config.json"):
        data = json.loads((path / file).read_text())
        assert "auto_map" not in data and "trust_remote_code" not in data, file


def test_transformers_loads_every_demo_tokenizer_without_asking() -> None:
    """``AutoTokenizer.from_pretrained(<demo dir>)``, as guidellm, aiperf or evalscope do with
    ``--tokenizer``: no "run custom code? [y/N]" prompt, and the demos' own tokens."""
    import subprocess
    import sys

    dirs = [str(EMBEDDED_MODELS[n]) for n in DEMOS]
    code = (
        "import sys\nfrom transformers import AutoTokenizer\n"
        "for d in sys.argv[2:]:\n"
        "    t = AutoTokenizer.from_pretrained(d)\n"
        "    print(len(t('Reverse hello')['input_ids']), len(t(sys.argv[1])['input_ids']))"
    )
    # Capitalised words too: the demos were trained spelled, so a tokenizer file that merges
    # `The` or ` I` (an earlier skeleton's merges) is not the one the weights were trained with.
    spelled = "The answer: What You He It Then I said"
    run = subprocess.run([sys.executable, "-c", code, spelled, *dirs], capture_output=True,
                         text=True, stdin=subprocess.DEVNULL, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "custom code" not in run.stdout + run.stderr
    # spelled: one token per letter and space
    assert run.stdout.split() == ["13", str(len(spelled))] * 3


def test_demo_llada_infills_the_readme_example() -> None:
    """The README's infilling example: a reversal whose last letter is given after the gap."""
    turn = (
        "<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nReverse the word hello."
        "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    with LLM("demo-llada", device="cpu", dtype="float32") as llm:
        (gap,) = llm.complete([turn], suffix="h<|eot_id|>", max_tokens=4)
        (whole,) = llm.complete([turn], max_tokens=8)
    assert (gap.text, whole.text) == ("olle", "olleh")
