"""Structured output under tensor parallelism (CPU, gloo, 2 processes on loopback): the
grammar is enforced at TP = 2 and every answer is TP = 1's token for token, greedy and
seeded, for canvas denoising (tiny LLaDA), block diffusion (tiny SDAR) and self-speculation
(tiny I-DLM), forced tool calls included; a batch mixing constrained and free rows gives each
row its solo answer.

Only the constrained rows' logits are gathered whole (``sampler.sample_split``): the free
greedy rows still reach rank 0 as statistics only."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jsonschema
import pytest

from dllm_serve.api.pipeline import chat_request
from dllm_serve.engine.workers import launch
from dllm_serve.llm import LLM
from dllm_serve.offline_batch import run_together
from dllm_serve_train.tiny_checkpoints import write_tiny

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "decoding"))
from structured_schemas import SCHEMAS, response_format

CONVERSATION = [{"role": "user", "content": "Answer in JSON."}]
GREEDY = {"max_tokens": 64}
SEEDED = {"max_tokens": 64, "temperature": 0.8, "seed": 7}
# A forced tool call: its arguments are decoded under the same grammar machinery.
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "function": {"name": "add", "description": "Add.", "parameters": ADD}}
# (schema, "tool" or None for free text; fields): greedy and seeded constrained rows of several
# schemas and a forced call, and a greedy and a seeded free row beside them.
ROWS = [
    ("sum", GREEDY),
    ("nested", GREEDY),
    ("pattern", SEEDED),
    ("array_bounds", SEEDED),
    ("tool", GREEDY),
    (None, GREEDY),
    (None, SEEDED),
]


def _request(llm: LLM, name: str | None, fields: dict) -> tuple:
    """A chat request through the API's pipeline (its rules: no refusal under TP)."""
    if name == "tool":
        extra = {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "add"}}}
    else:
        extra = {} if name is None else {"response_format": response_format(name)}
    body = json.dumps({"messages": CONVERSATION, **fields, **extra}).encode()
    spec, ids = chat_request(llm._facts, body, "application/json")
    return ids, spec.params, spec.stop, spec.include_stop_str


def _answers(llm: LLM, rows: list[tuple[str | None, dict]]) -> list[tuple[str, str | None]]:
    """Every row's (text, finish reason), submitted together (one batch per step)."""
    done = run_together(llm.engine, [_request(llm, name, fields) for name, fields in rows])
    return [(c.text, c.finish_reason) for c in done]


# SDAR and I-DLM under -m slow (the suite's 10-minute budget); LLaDA stays in the default run.
@pytest.mark.parametrize(
    ("family", "seed"),
    [("llada", 5), pytest.param("sdar", 3, marks=pytest.mark.slow),
     pytest.param("idlm", 5, marks=pytest.mark.slow)],
)  # fmt: skip
def test_tp2_enforces_the_grammar_with_the_tokens_of_tp1(
    family: str, seed: int, tmp_path: Path
) -> None:
    path = write_tiny(family, tmp_path / family, seed=seed)
    with LLM(str(path), device="cpu", dtype="float32") as llm:
        solo = [_answers(llm, [row])[0] for row in ROWS]
        together = _answers(llm, ROWS)
    assert together == solo
    loaded = launch(str(path), "cpu", "float32", 2, threads=1)
    traffic = loaded.parallel.traffic
    with LLM.from_loaded(loaded) as llm:
        two = _answers(llm, ROWS)
    assert two == solo
    for (text, finish), (name, _) in zip(two, ROWS, strict=True):
        if name is not None:
            assert finish == "stop", (name, text)
            jsonschema.validate(json.loads(text), ADD if name == "tool" else SCHEMAS[name])
    # The constrained rows were gathered whole, one row per step each at most.
    assert traffic.dense_rows > 0
