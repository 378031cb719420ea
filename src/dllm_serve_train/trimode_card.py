"""The README.md model card of a trained tri-mode demo (``demo-trimode``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dllm_serve_train.model_card import (
    operands_text,
    phrasing_table,
    questions_text,
    spelling_text,
)

_MODE_NAMES = {
    "ar": "`ar`",
    "diffusion": "`diffusion`",
    "linear_spec": "`linear_spec`, no LoRA",
    "linear_spec+lora": "`linear_spec` + draft LoRA",
}


def mode_table(by_mode: dict[str, Any]) -> str:
    """Accuracy per held-out set (rows) and mode (columns), then forwards and acceptance."""
    modes = [m for m in _MODE_NAMES if m in by_mode]
    sets = list(by_mode["ar"]["accuracy"])
    head = "| held-out, temperature 0 | " + " | ".join(_MODE_NAMES[m] for m in modes) + " |"
    lines = [head, "| --- " * (len(modes) + 1) + "|"]
    for name in sets:
        cells = [f"{100 * by_mode[m]['accuracy'][name]:.1f}%" for m in modes]
        lines.append(f"| {name.replace('_', ' ')} | " + " | ".join(cells) + " |")
    lines.append(
        "| forwards per answer token | "
        + " | ".join(f"{by_mode[m]['forwards_per_token']:.3f}" for m in modes)
        + " |"
    )
    lines.append(
        "| answer tokens per forward | "
        + " | ".join(f"{by_mode[m]['tokens_per_forward']:.2f}" for m in modes)
        + " |"
    )
    cells = []
    for m in modes:
        drafted, accepted = by_mode[m]["drafted"], by_mode[m]["accepted"]
        cells.append(f"{accepted}/{drafted} ({100 * accepted / drafted:.1f}%)" if drafted else "-")
    lines.append("| drafts accepted | " + " | ".join(cells) + " |")
    same = [
        f"{by_mode[m]['same_answers_as_ar']}/{by_mode['questions']}"
        if "same_answers_as_ar" in by_mode[m]
        else "-"
        for m in modes
    ]
    lines.append("| same answer as `ar` | " + " | ".join(same) + " |")
    return "\n".join(lines)


def _earlier_stages(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The stages this run continued from (``--init``), first to last."""
    chain, stage = [], report.get("init_from")
    while stage:
        chain.insert(0, stage)
        stage = stage.get("init_from")
    return chain


def trimode_phrasings(report: dict[str, Any], server: dict | None) -> str:
    run = report.get("held_out_phrasings") or {}
    columns = [(f"`{m}` (engine)", run[m]) for m in ("ar", "linear_spec") if m in run]
    modes = (server or {}).get("modes", {})
    if "default" in modes:
        columns.append(("`linear_spec` + LoRA, through `dllm-serve`", modes["default"]))
    if "ar" in modes:
        columns.append(("`ar`, through `dllm-serve`", modes["ar"]))
    text = phrasing_table(columns, modes.get("default"))
    if not text:
        return ""
    text = "\n" + text
    spec = run.get("linear_spec", {})
    if "same_answers_as_ar" in spec:
        text += (
            f"\n`linear_spec`{' with the draft LoRA' if spec.get('lora') else ''} gave "
            f"exactly `ar`'s answer to {spec['same_answers_as_ar']} of the {spec['answers']} "
            "conversations of this table.\n"
        )
    return text


def write_trimode_card(
    out: Path, name: str, report: dict[str, Any], server_phrasings: dict | None = None
) -> None:
    config = json.loads((out / "config.json").read_text())
    by_mode = report["held_out_by_mode"]
    ratio = (
        by_mode["ar"]["forwards_per_token"]
        / by_mode.get("linear_spec+lora", by_mode["linear_spec"])["forwards_per_token"]
    )
    lora = report.get("draft_lora")
    earlier = _earlier_stages(report)
    minutes = (report["cpu_seconds"] + (lora["cpu_seconds"] if lora else 0)) / 60
    before = sum(
        s.get("cpu_seconds", 0) + (s.get("draft_lora") or {}).get("cpu_seconds", 0) for s in earlier
    )
    chain = (
        "\n- Continued (`--init`) from an earlier run's weights; its draft LoRA was not "
        "reused (the LoRA above is trained on these weights). The earlier run(s), "
        f"{before / 60:.0f} CPU-minutes with their LoRA:\n\n"
        + "\n".join(f"      {s['command']}" for s in earlier)
        + f"\n\n  All stages together: {minutes + before / 60:.0f} CPU-minutes.\n"
        if earlier
        else ""
    )
    weights = ", ".join(f"{t} {w}" for t, w in report["task_weights"].items() if w)
    lora_line = (
        f"- Draft LoRA (`draft-lora/`, PEFT): rank {lora['rank']}, alpha {lora['alpha']:g} on "
        f"every layer's `o_proj`, {lora['steps']} steps at lr {lora['lr']:g} on the frozen "
        f"model, LinearSpec drafts only (diffusion loss), {lora['cpu_seconds'] / 60:.0f} "
        "CPU-minutes. Served with `--draft-lora DIR/draft-lora`, DIR being this checkpoint "
        "(the embedded demo-trimode's is `--draft-lora demo-trimode-lora`)."
        if lora and "linear_spec+lora" in by_mode
        else "- No draft LoRA."
    )
    with_lora = " with the draft LoRA" if "linear_spec+lora" in by_mode else ""
    # A ratio below 1 (an undertrained model whose drafts are rejected) reads as "more".
    fewer = f"{ratio:.2f}× fewer" if ratio >= 1 else f"{1 / ratio:.2f}× more"
    spelled = spelling_text(report) or "; words and numbers use the format's BPE merges"
    operands = operands_text(report) or "\n  Additions: operands uniform in 0-999."
    text = f"""# {name}

A small **tri-mode** model in the Nemotron-Labs-Diffusion on-disk format (`encoder.*`,
`diffusion_head`, YaRN RoPE), trained by dllm-serve on the demo task mix so that all three
decoding modes can be tried with no download and no GPU: `ar` (causal, the exactness
anchor), `diffusion` (blocks of {config["block_size"]} denoised in the bidirectional view
over a causal prefix, with the causal KV refresh) and `linear_spec` (a block drafted in the
diffusion view, verified in the causal view). It is not a general chat model.

Held out, measured through the serving engine at the settings a chat request with that
`decoding_mode` gets from the server ({by_mode["questions"]} questions; forwards include
the prefill):

{mode_table(by_mode)}

`linear_spec`{with_lora} takes **{fewer} forwards per answer token than `ar`**, with the
same answers (LinearSpec's verify is exact at temperature 0).
{trimode_phrasings(report, server_phrasings)}
- Questions: {questions_text(report)}
- Objective (stage 1): the release's joint loss `ar_loss_weight · L_AR + dlm_loss_weight ·
  L_DLM` (1 and 1) on a dual-stream row per example: the clean `prompt + answer` under causal
  attention with next-token targets, and a noisy block of {config["block_size"]} tokens at
  the answer's positions from a random cut, attending to the causal prefix left of the cut
  and to itself; its first token is the clean seed, the rest masked entirely (a LinearSpec
  draft, half the rows) or at a random ratio (a `diffusion` block); masked positions predict
  their own token.
- Task mix (relative weights): {weights}.{operands}
- Tokens: the format's tokenizer{spelled}.
- Shape: hidden {config["hidden_size"]}, {config["num_hidden_layers"]} layers,
  {config["num_attention_heads"]} heads / {config["num_key_value_heads"]} KV heads (head dim
  {config["head_dim"]}), MLP {config["intermediate_size"]}, {report["parameters"]:,}
  parameters, bf16; RoPE theta {config["rope_parameters"]["rope_theta"]:g} (32-dimensional
  heads need turning frequencies at these lengths); mask id {config["mask_token_id"]}.
- Stage 1: {report["steps"]} steps of {report["batch_size"]} examples, AdamW, warm-up then
  cosine, {report["cpu_seconds"] / 60:.0f} CPU-minutes on {report["machine"]}.
{lora_line}
- Both stages together: {minutes:.0f} CPU-minutes. The exact command:

      {report["command"]}
{chain}"""
    (out / "README.md").write_text(text)
