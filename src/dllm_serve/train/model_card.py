"""The README.md model card written next to a trained demo checkpoint."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

from dllm_serve.train.tasks import TASKS

_OBJECTIVE = {
    "llada": (
        "LLaDA's masked-diffusion objective: the answer region (answer, end-of-turn token and "
        "EOS padding, which is trained as ordinary tokens as in LLaDA's SFT) is masked with a "
        "per-row ratio t ~ U(0.001, 1) (stratified across the batch); cross-entropy on the "
        "masked positions ({weighting}); bidirectional attention; the prompt is never masked."
    ),
    "idlm": (
        "Introspective causal training (I-DLM): strictly causal attention with logit shift "
        "(position j predicts token j+1); the answer is cut at a random point and followed by "
        "0-7 MASK tokens, the tail layout of a self-speculative round, and every clean and MASK "
        "position predicts its true next token, so MASK drafts learn to agree with the causal "
        "path."
    ),
}
_WEIGHTING = {
    "token_mean": "averaged over the batch's masked tokens",
    "inverse_t": "each weighted by 1/t, LLaDA's ELBO weight",
    "row_mean": "averaged per row over its masked tokens, then over rows: LLaDA's 1/t "
    "ELBO weight with the expected masked count t·length replaced by the realised count",
    None: "averaged over the batch's masked tokens",
}
_DECODING = {
    "llada": "temperature 0, canvas 32 (`max_new_tokens`), 32 steps, one block, top-1 "
    "confidence, low-confidence remasking: the server's defaults for this model",
    "idlm": "temperature 0, up to 32 tokens; greedy, which is exactly what self-speculative "
    "decoding returns at temperature 0 (the server's defaults for this model)",
}


def write_model_card(out: Path, name: str, family: str, report: dict[str, Any]) -> None:
    config = json.loads((out / "config.json").read_text())
    size_mb = (out / "model.safetensors").stat().st_size / 1e6
    scores = report["held_out_exact_match"]
    rows = "\n".join(
        f"| {task} | {scores[task] * 100:.1f}% | {report['held_out_counts'][task]} |"
        for task in TASKS
    )
    d = config.get("d_model") or config.get("hidden_size")
    layers = config.get("n_layers") or config.get("num_hidden_layers")
    operands = _operands(report)
    objective = _OBJECTIVE[family].format(weighting=_WEIGHTING[report.get("weighting")])
    objective += _recipe(report)
    kind = "LLaDA-format masked diffusion" if family == "llada" else "I-DLM-format causal"
    text = f"""# {name}

A small {kind} model trained by dllm-serve on a synthetic task mix,
so that the server answers sensibly with no download and no GPU. It is not a general chat
model: it answers the six kinds of question below.

| held-out task (exact match) | accuracy | questions |
| --- | --- | --- |
{rows}

Decoding for the table: {_DECODING[family]}.

- Questions: `What is 123 + 456?` (answer `123 + 456 = 579`, operands uniform in 0-999),
  `What is 900 - 12?`, `Reverse the word abc.`, `Sort the letters of cab.`,
  `How many times does a appear in banana?`, `Given a=1, b=2, c=3, what is b?`
  (`dllm_serve/train/tasks.py`). 10% of all questions, chosen by a hash of the question text,
  are held out: training never sees them, and the table is measured on them.
- Task mix: addition weight {report["addition_weight"]}, each other task weight 1.{operands}
- Objective: {objective}
- Shape: d_model {d}, {layers} layers, {report["parameters"]:,} parameters, stored in bf16
  ({size_mb:.1f} MB). Real chat template, tokenizer and special tokens of the format (see
  `docs/models.md`); `generation_config.json` sets `max_new_tokens` 32, the server's default
  canvas for this model.
- Training: {_training(report)}
"""
    (out / "README.md").write_text(text)


def _operands(report: dict[str, Any]) -> str:
    how = {
        "mixed": "half of them with operands uniform in 0-999, half with each operand's\n"
        "  digit count (1-3) drawn uniformly first, so short sums are common",
        "curriculum": "short operands first (each operand's digit count 1-3 drawn uniformly),\n"
        "  their share falling linearly to none at 3/4 of the steps",
    }.get(report.get("addition_operands") or "uniform")
    if how is None:
        return ""
    return f"\n  Training additions: {how} (held-out additions are always uniform in 0-999)."


def _recipe(report: dict[str, Any]) -> str:
    """The LLaDA recipe's departures from plain random masking, when used."""
    text = ""
    if report.get("ar_fraction"):
        text += (
            f"\n  {report['ar_fraction']:.0%} of each batch's rows are two-stream "
            "autoregressive rows instead: the answer follows the prompt clean, then a MASK "
            "copy of it at the same rotary positions in which each MASK sees the prompt, the "
            "clean answer before it and itself, and predicts its own token (every answer "
            "token from a clean left context, the state left-to-right denoising reaches); "
            "the random-ratio rows teach every other state."
        )
    if report.get("causal_steps"):
        text += (
            f"\n  The first {report['causal_steps']} steps used a causal attention mask "
            "(same rows and targets, no logit shift), the rest bidirectional attention."
        )
    return text


def _training(report: dict[str, Any]) -> str:
    stages = [*([report["init_from"]] if "init_from" in report else []), report]
    total = sum(s["seconds"] for s in stages) / 60
    text = (
        f"{' then '.join(str(s['steps']) for s in stages)} steps of {report['batch_size']} "
        f"examples, AdamW, linear warm-up then cosine decay, {total:.0f} minutes in all on "
        f"{report['machine']}"
    )
    if len(stages) == 1:
        return f"{text}:\n\n      {report['command']}"
    return (
        f"{text}, in two stages: the second continues from the first's weights at a lower "
        f"learning rate on a fresh example stream (another seed):\n\n"
        + "\n".join(f"      {s['command']}" for s in stages)
    )


def machine(threads: int, device: str) -> str:
    if device != "cpu":
        return f"{device} ({platform.machine()})"
    return f"{threads} CPU thread(s), {platform.processor() or platform.machine()}"
