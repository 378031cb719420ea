"""Held-out evaluation of a tri-mode demo per decoding mode, through the serving engine.

For each mode (``ar``, ``diffusion``, ``linear_spec``, and ``linear_spec`` with the draft
LoRA) at the settings a chat request with that ``decoding_mode`` gets from the server,
temperature 0: exact match per task set, forwards per answer token (NFE over completion
tokens, the prefill included), and for LinearSpec the drafted/accepted counts.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from dllm_serve.config import EngineConfig
from dllm_serve.llm import LLM
from dllm_serve.models.loader import load_model
from dllm_serve.models.lora import attach_draft_lora
from dllm_serve_train.evaluation import phrasing_sets, score_phrasings, server_params
from dllm_serve_train.tasks import STRATA, held_out_additions, held_out_set

MODES = ("ar", "diffusion", "linear_spec", "linear_spec+lora")


def held_out_sets(n_addition: int, n_other: int, tasks: tuple[str, ...]) -> dict[str, list]:
    """Addition per operand stratum, then each other trained task."""
    sets: dict[str, list] = {}
    for name in STRATA:
        sets[f"addition_{name}"] = held_out_additions(name, n_addition)
    for task in tasks:
        if task != "addition":
            sets[task] = held_out_set(n_other, task=task)
    return sets


def _llm(model_dir: Path, lora_dir: Path | None) -> LLM:
    loaded = load_model(str(model_dir), device="cpu", dtype="float32")
    if lora_dir is not None:
        attach_draft_lora(loaded.model, lora_dir)
    config = EngineConfig(max_running_requests=64, max_waiting_requests=1 << 20)
    return LLM.from_loaded(loaded, config)


def evaluate_phrasings_by_mode(model_dir: Path, lora_dir: Path | None) -> dict[str, dict]:
    """The held-out phrasings (``evaluation.score_phrasings``) in ``ar`` and in
    ``linear_spec`` with the draft LoRA when there is one (the served default), and how
    many of all the answers the two modes share."""
    sets = phrasing_sets()
    results: dict[str, dict] = {}
    texts: dict[str, list[str]] = {}
    for mode in ("ar", "linear_spec"):
        params = dataclasses.replace(server_params(None), decoding_mode=mode)
        seen: list[str] = []
        with _llm(model_dir, lora_dir if mode == "linear_spec" else None) as llm:

            def generate(conversations: list, llm=llm, params=params, seen=seen) -> list[str]:
                answers = [o.text for o in llm.generate(conversations, params)]
                seen.extend(answers)
                return answers

            results[mode] = score_phrasings(generate, sets)
        texts[mode] = seen
    results["linear_spec"]["same_answers_as_ar"] = sum(
        a == b for a, b in zip(texts["linear_spec"], texts["ar"], strict=True)
    )
    results["linear_spec"]["answers"] = len(texts["ar"])
    results["linear_spec"]["lora"] = lora_dir is not None
    return results


def evaluate_modes(
    model_dir: Path,
    lora_dir: Path | None,
    tasks: tuple[str, ...],
    n_addition: int = 100,
    n_other: int = 100,
    canvas: int = 32,
) -> dict[str, dict]:
    """``{mode: {"accuracy": {set: share}, "forwards_per_token": x, "tokens_per_forward": y,
    "drafted": d, "accepted": a, "answers": [...]}}``; ``answers`` (every completion text in
    set order) lets callers check that LinearSpec answered exactly what AR answered."""
    sets = held_out_sets(n_addition, n_other, tasks)
    conversations = [e.messages() for s in sets.values() for e in s]
    expected = [e.answer for s in sets.values() for e in s]
    config = EngineConfig(max_running_requests=64, max_waiting_requests=1 << 20)
    results: dict[str, dict] = {}
    for mode in MODES:
        if mode.endswith("+lora") and lora_dir is None:
            continue
        loaded = load_model(str(model_dir), device="cpu", dtype="float32")
        if mode.endswith("+lora"):
            attach_draft_lora(loaded.model, lora_dir)
        params = dataclasses.replace(
            server_params(None, canvas), decoding_mode=mode.removesuffix("+lora")
        )
        with LLM.from_loaded(loaded, config) as llm:
            outs = llm.generate(conversations, params)
        accuracy, start = {}, 0
        for name, exs in sets.items():
            got = outs[start : start + len(exs)]
            right = sum(o.text.strip() == e for o, e in zip(got, expected[start:], strict=False))
            accuracy[name] = round(right / len(exs), 4)
            start += len(exs)
        tokens = sum(o.completion_tokens for o in outs)
        forwards = sum(o.nfe for o in outs)
        results[mode] = {
            "accuracy": accuracy,
            "forwards_per_token": round(forwards / max(tokens, 1), 4),
            "tokens_per_forward": round(tokens / max(forwards, 1), 4),
            "drafted": sum(o.drafted for o in outs),
            "accepted": sum(o.accepted_drafts for o in outs),
            "answers": [o.text for o in outs],
        }
    return results
