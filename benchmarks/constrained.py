"""Structured output's cost: forwards per answer token and wall time per step, constrained vs not.

    python benchmarks/constrained.py --threads 1     # demo-llada + a tiny random LLaDA2.x

For each model, commit rule and prompt, three requests run one after another through the offline
``LLM.chat`` (the API's rules, temperature 0), so machine drift hits all three alike:

- ``free``: no ``response_format``;
- ``constrained``: the schema enforced as the server does it (grammar mask on the first open
  position, the block-window lookahead choosing its token, the valid left-to-right run kept);
- ``masked only``: the same with the lookahead's window cut to one position (plain masking of
  the first open position), to show what the lookahead costs and buys.

Reported per variant: forwards (NFE) per answer token, milliseconds of wall time per forward
(the whole request's time over its forwards: the API pipeline, the forward, the sampler and
the host-side matcher), answers ending with ``stop``, and answers that parse as JSON and
validate. Models: demo-llada (trained; "What is a + b?" with ``{"sum": integer}``) and, for
block diffusion, a tiny random LLaDA2.x checkpoint (block 8; gibberish weights, so its free
answers never parse) with a nested schema and 64 tokens (its tokens are short pieces); for
self-speculation, demo-idlm (ISD, stride 4) with ``{"sum": integer 0–9999}`` (free and
constrained only: causal decoding has no lookahead window).
Writes ``benchmarks/results/constrained.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    PROMPTS,
    RESULTS_DIR,
    add_threads_option,
    apply_threads,
    at_least,
    machine_info,
    write_json,
)

from dllm_serve.decoding import structured
from dllm_serve.llm import LLM
from dllm_serve_train.tiny_checkpoints import write_tiny_llada2

SUM = {
    "type": "object",
    "properties": {"sum": {"type": "integer"}},
    "required": ["sum"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "user": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 6},
                "role": {"enum": ["admin", "guest"]},
            },
            "required": ["name", "role"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["user", "tags"],
    "additionalProperties": False,
}
# demo-idlm decodes causally (ISD): no later position's distribution to look ahead with, so an
# unbounded integer runs on; its schema bounds the sum (four digits at most).
BOUNDED_SUM = {
    "type": "object",
    "properties": {"sum": {"type": "integer", "minimum": 0, "maximum": 9999}},
    "required": ["sum"],
    "additionalProperties": False,
}
ADDITIONS = [(2, 2), (123, 456), (7, 5), (40, 2), (250, 250), (19, 23), (8, 8), (301, 99)]
RULES: dict[str, dict[str, Any]] = {"top-k": {}, "threshold 0.9": {"confidence_threshold": 0.9}}


def _valid(text: str, schema: dict[str, Any]) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    try:
        import jsonschema
    except ImportError:  # the dev extra has it; without it, parsing is all that is checked
        return True
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True


def _run(llm: LLM, conversation: list, fields: dict[str, Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = llm.chat([conversation], **fields)[0]
    return out, time.perf_counter() - start


def measure(
    model: str,
    schema: dict[str, Any],
    conversations: list,
    max_tokens: int,
    device: str,
    variants: tuple[str, ...] = ("free", "constrained", "masked only"),
) -> dict[str, Any]:
    """Every rule × variant's totals for one model."""
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": schema, "strict": True},
    }
    depth = structured.LOOKAHEAD_DEPTH
    rows = []
    with LLM(model, device=device, dtype="float32") as llm:
        llm.chat([conversations[0]], response_format=response_format, max_tokens=max_tokens)
        rules = RULES if llm.engine.decoding_mode != "self_speculation" else {"ISD": {}}
        for rule, setting in rules.items():
            totals = {v: {"nfe": 0, "tokens": 0, "seconds": 0.0, "stop": 0, "valid": 0}
                      for v in variants}  # fmt: skip
            for conversation in conversations:
                for variant in totals:
                    fields = {"max_tokens": max_tokens, **setting}
                    if variant != "free":
                        fields["response_format"] = response_format
                    structured.LOOKAHEAD_DEPTH = 1 if variant == "masked only" else depth
                    try:
                        out, seconds = _run(llm, conversation, fields)
                    finally:
                        structured.LOOKAHEAD_DEPTH = depth
                    t = totals[variant]
                    t["nfe"] += out.nfe
                    t["tokens"] += out.completion_tokens
                    t["seconds"] += seconds
                    t["stop"] += out.finish_reason == "stop"
                    t["valid"] += _valid(out.text, schema)
            for variant, t in totals.items():
                rows.append({
                    "rule": rule, "variant": variant, "requests": len(conversations),
                    "nfe": t["nfe"], "answer_tokens": t["tokens"],
                    "nfe_per_answer_token": round(t["nfe"] / max(t["tokens"], 1), 3),
                    "ms_per_forward": round(1e3 * t["seconds"] / max(t["nfe"], 1), 3),
                    "stopped": t["stop"], "valid_json": t["valid"],
                })  # fmt: skip
                r = rows[-1]
                print(f"{llm.loaded.name:12s} {rule:14s} {variant:12s} NFE/token "
                      f"{r['nfe_per_answer_token']:6.3f}  ms/forward {r['ms_per_forward']:7.3f}  "
                      f"stop {r['stopped']}/{len(conversations)}  "
                      f"valid {r['valid_json']}/{len(conversations)}")  # fmt: skip
        return {"model": llm.loaded.name, "family": llm.loaded.family.name, "rows": rows}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-tokens", type=at_least(1), default=32, help="demo-llada's")
    parser.add_argument(
        "--tiny-max-tokens", type=at_least(1), default=64, help="the tiny LLaDA2.x's (nested)"
    )
    parser.add_argument("--prompts", type=at_least(1), default=len(ADDITIONS))
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "constrained.json")
    add_threads_option(parser)
    args = parser.parse_args(argv)
    apply_threads(args.threads)
    additions = [
        [{"role": "user", "content": f"What is {a} + {b}?"}] for a, b in ADDITIONS[: args.prompts]
    ]
    questions = [[{"role": "user", "content": p}] for p in PROMPTS[: args.prompts]]
    tiny = write_tiny_llada2(Path(tempfile.mkdtemp()) / "tiny-llada2", block_size=8, seed=3)
    report = {
        "benchmark": "constrained",
        "max_tokens": {"demo-llada": args.max_tokens, "tiny-llada2": args.tiny_max_tokens},
        "lookahead": {
            "depth": structured.LOOKAHEAD_DEPTH,
            "beams": structured.LOOKAHEAD_BEAMS,
            "candidates": structured.LOOKAHEAD_CANDIDATES,
        },
        "models": [
            measure("demo-llada", SUM, additions, args.max_tokens, args.device),
            measure(str(tiny), NESTED, questions, args.tiny_max_tokens, args.device),
            measure(
                "demo-idlm",
                BOUNDED_SUM,
                additions,
                args.max_tokens,
                args.device,
                variants=("free", "constrained"),
            ),
        ],
        "machine": machine_info(),
    }
    write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
