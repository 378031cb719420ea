"""The model card states the recipe that the training report records."""

from __future__ import annotations

from pathlib import Path

import pytest

from dllm_serve.models.tiny import write_tiny
from dllm_serve.train.model_card import write_model_card
from dllm_serve.train.tasks import TASKS


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
        "command": "python -m dllm_serve.train --family llada",
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
