"""The model card states the recipe that the training report records."""

from __future__ import annotations

from pathlib import Path

import pytest

from dllm_serve_train.model_card import phrasing_table, write_model_card
from dllm_serve_train.tasks import TASKS
from dllm_serve_train.tiny_checkpoints import write_tiny


def _report(**recipe: object) -> dict:
    return {
        "held_out_exact_match": {t: 0.5 for t in TASKS},
        "held_out_counts": {t: 10 for t in TASKS},
        "addition_weight": 8,
        "parameters": 1234,
        "steps": 10,
        "batch_size": 4,
        "seconds": 60,
        "machine": "1 CPU thread(s), x86_64",
        "command": "python -m dllm_serve_train --family llada",
        **recipe,
    }


@pytest.mark.parametrize(
    ("recipe", "stated", "not_stated"),
    [
        (
            {"weighting": "row_mean", "addition_operands": "mixed"},
            ["realised count", "digit count (1-3)"],
            [],
        ),
        (
            {"weighting": "token_mean", "addition_operands": "uniform"},
            ["batch's masked tokens"],
            ["digit count"],
        ),
        ({"weighting": "inverse_t"}, ["1/t, LLaDA's ELBO weight"], ["digit count", "realised"]),
        (
            {"weighting": "token_mean", "addition_operands": "curriculum"},
            ["short operands first", "none at 3/4 of the steps"],
            ["half of them"],
        ),
        (
            {"weighting": "token_mean", "ar_fraction": 0.75},
            ["75% of each batch's rows are two-stream autoregressive rows"],
            ["causal attention mask"],
        ),
        (
            {"weighting": "token_mean", "causal_steps": 300, "ar_fraction": 0.0},
            ["The first 300 steps used a causal attention mask"],
            ["two-stream"],
        ),
    ],
)
def test_card_states_weighting_and_operands(
    tmp_path: Path, recipe: dict, stated: list[str], not_stated: list[str]
) -> None:
    out = write_tiny("llada", tmp_path / "m")
    write_model_card(out, "demo-llada", "llada", _report(**recipe))
    card = (out / "README.md").read_text()
    assert card.startswith("# demo-llada\n")
    for text in stated:
        assert text in card
    for text in not_stated:
        assert text not in card
    assert "| addition | 50.0% | 10 |" in card


def test_card_reports_each_stratum_at_each_canvas_and_the_server_measurement(
    tmp_path: Path,
) -> None:
    out = write_tiny("llada", tmp_path / "m")
    names = ["addition_1+1", "addition_3+3", "reverse_word"]
    scores = {f"{n}@{c}": 0.25 * i for i, n in enumerate(names) for c in (32, 1024)}
    server = {
        "accuracy": {
            key: {n: {"accuracy": 0.5, "right": 5, "of": 10} for n in names}
            for key in ("default", "1024")
        },
        "same_answer_at_every_canvas": {"questions": 30, "same": 29},
    }
    report = _report(
        held_out_exact_match=scores,
        held_out_counts={n: 10 + i for i, n in enumerate(names)},
        task_weights={"addition": 10, "reverse_word": 3, "subtraction": 0},
        tail_rows=3,
        spelled=True,
        addition_operands="stratified",
    )
    write_model_card(out, "demo-x", "llada", report, server)
    card = (out / "README.md").read_text()
    assert "| held-out (exact match, temperature 0) | max_tokens 32 | max_tokens 1024 |" in card
    assert "| addition, 3+3 digits | 25.0% | 25.0% | 11 |" in card
    assert "| reverse an English word | 50.0% | 50.0% | 12 |" in card
    assert "| no max_tokens | max_tokens 1024 |" in card
    assert "29 of 30 questions" in card
    assert "addition 10, reverse_word 3." in card  # zero weights are not in the mix
    assert "spelled one character per token" in card
    assert "log-uniformly" in card
    assert "nine\n  length pairs" in card


def test_card_states_cpu_minutes_of_every_stage_when_recorded(tmp_path: Path) -> None:
    out = write_tiny("llada", tmp_path / "m")
    first = {"command": "train stage 1", "steps": 30, "seconds": 7200, "cpu_seconds": 4800}
    write_model_card(out, "demo-llada", "llada", _report(cpu_seconds=540, init_from=first))
    card = (out / "README.md").read_text()
    # 4800 + 540 CPU seconds; the wall clock (7200 + 60) is stated beside it, not as the budget
    assert "89 CPU-minutes in all (121 minutes of wall time)" in card
    assert "30 then 10 steps" in card
    del first["cpu_seconds"]  # a stage without CPU time: only the wall clock can be stated
    write_model_card(out, "demo-llada", "llada", _report(cpu_seconds=540, init_from=first))
    assert "121 minutes in all on" in (out / "README.md").read_text()


def test_card_states_a_stage_that_grew_the_model(tmp_path: Path) -> None:
    out = write_tiny("idlm", tmp_path / "m")
    first = {"command": "python -m dllm_serve_train --n-layers 4", "steps": 30, "seconds": 60}
    grown = "python -m dllm_serve_train --n-layers 6 --init /runs/p8 --grow-layers"
    write_model_card(out, "demo-idlm", "idlm", _report(command=grown, init_from=first))
    card = (out / "README.md").read_text()
    assert "; stage 2 grew the model from 4 to 6 layers (`--grow-layers`: each added" in card
    write_model_card(out, "demo-idlm", "idlm", _report(init_from=first))
    assert "grew the model" not in (out / "README.md").read_text()


def test_an_idlm_card_states_its_autoregressive_rows(tmp_path: Path) -> None:
    out = write_tiny("idlm", tmp_path / "m")
    write_model_card(out, "demo-idlm", "idlm", _report(ar_fraction=0.5))
    card = (out / "README.md").read_text()
    assert "50% of each batch's rows keep the whole answer clean and no MASK" in card
    assert "two-stream" not in card
    write_model_card(out, "demo-idlm", "idlm", _report())
    assert "keep the whole answer clean" not in (out / "README.md").read_text()


def test_card_states_what_the_run_did_not_a_fixed_recipe(tmp_path: Path) -> None:
    """Found by QA: the card said max_new_tokens 32 for --canvas 16, a 16-1024 tail canvas for
    --tail-min-canvas 64, "a lower learning rate ... another seed" for a second stage run with
    the same ones, and left the questions cell of the overall addition row empty."""
    import json

    out = write_tiny("llada", tmp_path / "m")
    (out / "generation_config.json").write_text(json.dumps({"max_new_tokens": 16}))
    first = {"command": "python -m dllm_serve_train --lr 0.003", "steps": 30, "seconds": 60}
    report = _report(
        held_out_exact_match={"addition_1+1": 1.0, "addition_3+3": 0.5, "addition": 0.75},
        held_out_counts={"addition_1+1": 10, "addition_3+3": 250},
        tail_rows=2,
        tail_min_canvas=64,
        init_from=first,
    )
    write_model_card(out, "demo-x", "llada", report)
    card = (out / "README.md").read_text()
    assert "sets `max_new_tokens` 16, the server" in card and "as the 16-token one is" in card
    assert "max_new_tokens` 32" not in card
    assert "a canvas of 64 to 1024 positions" in card
    assert "lower learning rate" not in card and "learning rate and seed are in its command" in card
    assert "| addition, 3+3 digits | 50.0% | 250 |" in card
    assert "| addition | 75.0% | 260 |" in card


def test_card_states_the_phrasings_its_run_trained_on(tmp_path: Path) -> None:
    """A card regenerated after phrasings were added states the run's counts, not today's."""
    from dllm_serve_train.phrasings import phrasing_counts

    out = write_tiny("llada", tmp_path / "m")
    recorded = {"addition": 48, "reverse_word": 32}
    assert phrasing_counts() != recorded
    write_model_card(out, "demo-x", "llada", _report(phrasing=0.85, phrasing_templates=recorded))
    card = (out / "README.md").read_text()
    assert "asked in 48 phrasings" in card and "word reversals in 32 (" in card
    write_model_card(out, "demo-x", "llada", _report(phrasing=0.85))  # an older report
    now = phrasing_counts()
    card = (out / "README.md").read_text()
    assert f"asked in {now['addition']} phrasings" in card
    assert f"word reversals in {now['reverse_word']} (" in card
    assert "composed from parts" not in card  # a run without --composed
    write_model_card(out, "demo-x", "llada", _report(phrasing=0.85, composed=0.5))
    card = (out / "README.md").read_text()
    assert "other than the first (50% of those reversals in one composed from parts" in card
    assert "as their verb" not in card  # a run without --unfamiliar-verbs
    write_model_card(
        out, "demo-x", "llada", _report(phrasing=0.85, composed=0.5, unfamiliar_verbs=0.4)
    )
    card = (out / "README.md").read_text()
    assert "; 40% of those with another word of the task as their verb" in card
    assert "consistency term" not in card  # a run without --consistency
    write_model_card(out, "demo-x", "llada", _report(phrasing=0.85, context=0.6, consistency=1.0))
    card = (out / "README.md").read_text()
    assert (
        "the answer is the last question's, held to the answer the question gets alone by a "
        "consistency term (`--consistency 1`" in card
    )


def test_trimode_card_states_the_run_without_a_lora_and_a_slower_linear_spec(
    tmp_path: Path,
) -> None:
    """Found by QA: with --lora-steps 0 the card praised "the draft LoRA" and also said "No
    draft LoRA", a ratio below 1 read "0.52× fewer", and spelled stratified operands were
    claimed whatever the run used."""
    from dllm_serve_train.model_card import write_trimode_card

    out = write_tiny("nemotron", tmp_path / "t")
    mode = {"accuracy": {"addition_1+1": 0.5}, "forwards_per_token": 1.0, "tokens_per_forward": 1.0,
            "drafted": 0, "accepted": 0}  # fmt: skip
    slower = {**mode, "forwards_per_token": 2.0, "same_answers_as_ar": 2}
    by_mode = {"ar": mode, "diffusion": mode, "linear_spec": slower, "questions": 2}
    report = _report(held_out_by_mode=by_mode, cpu_seconds=60, task_weights={"addition": 1},
                     addition_operands="uniform", spelled=False)  # fmt: skip
    write_trimode_card(out, "demo-t", report)
    card = (out / "README.md").read_text()
    assert "`linear_spec` takes **2.00× more forwards per answer token than `ar`**" in card
    assert "draft LoRA takes" not in card and "- No draft LoRA." in card
    assert "operands uniform in 0-999" in card and "digit count" not in card
    assert "spelled one character" not in card and "the format's BPE merges" in card


def test_card_lists_each_reversal_phrasing_worst_first(tmp_path: Path) -> None:
    """Which held-out and fresh reversal phrasings a demo misses, from the server's measurement
    (not only the run's), worst first."""
    out = write_tiny("idlm", tmp_path / "m")
    cell = {"right": 26, "of": 51, "accuracy": 0.5098}
    run = {"reverse_word": {**cell, "by_phrasing": {"Say {w} backwards.": [0, 1]}}}
    phrasings = {
        "modes": {
            "default": {
                "reverse_word": {
                    **cell,
                    "by_phrasing": {
                        "Say {w} backwards.": [25, 25],
                        "Give me {w} reversed.": [1, 26],
                    },
                },
                "reverse_word_fresh": {
                    "right": 9,
                    "of": 33,
                    "accuracy": 0.2727,
                    "by_phrasing": {"Do {w} in reverse.": [9, 16], "{w} but backwards": [0, 17]},
                },
            }
        }
    }
    write_model_card(
        out, "demo-x", "idlm", _report(held_out_phrasings=run), server_phrasings=phrasings
    )
    card = (out / "README.md").read_text()
    assert (
        "Right of asked, per held-out reversal phrasing, worst first: "
        "`Give me {w} reversed.` 1/26, `Say {w} backwards.` 25/25." in card
    )
    assert (
        "Right of asked, per fresh reversal phrasing, worst first: "
        "`{w} but backwards` 0/17, `Do {w} in reverse.` 9/16." in card
    )


def test_card_question_counts_name_each_measurement_s_own() -> None:
    """The training run's held-out sets and the server's can differ by a few questions: the
    questions column gives each count once, in column order, not the first column's alone."""
    run = {"addition": {"right": 9, "of": 10, "accuracy": 0.9}}
    run["system_prompt"] = {"same": 580, "of": 600}
    server = {"addition": {"right": 9, "of": 10, "accuracy": 0.9}}
    server["system_prompt"] = {"same": 585, "of": 603}
    table = phrasing_table([("the run", run), ("the server", server)])
    assert "| additions, operands of 1-3 digits | 90.0% (9/10) | 90.0% (9/10) | 10 |" in table
    assert "| same answer after a held-out system prompt | 580/600 | 585/603 | 600 / 603 |" in table
