"""The README.md model cards written next to the trained demo checkpoints (the LLaDA and I-DLM
demos, and the tri-mode demo with its modes table), and the card rewriter."""

from __future__ import annotations

import json
import platform
import re
from pathlib import Path
from typing import Any

from dllm_serve.decoding.params import DEFAULT_GEN_LENGTH
from dllm_serve_train.off_topic import CAPABILITY_REPLY
from dllm_serve_train.phrasings import ADDITION, REVERSAL, phrasing_counts

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


def write_model_card(
    out: Path,
    name: str,
    family: str,
    report: dict[str, Any],
    server: dict | None = None,
    server_phrasings: dict | None = None,
) -> None:
    """The card: held-out accuracy (from ``report``, the training run's own evaluation, and
    from ``server``, ``benchmarks/demo_accuracy.py``'s measurement through a real server, when
    given), how it does on held-out phrasings (the run's, and ``server_phrasings``,
    ``benchmarks/demo_phrasings.py``'s, when given), the recipe and the exact command."""
    config = json.loads((out / "config.json").read_text())
    # The canvas the run trained and wrote, as its generation_config.json records it.
    generation = out / "generation_config.json"
    gen = json.loads(generation.read_text()) if generation.is_file() else {}
    canvas = gen.get("max_new_tokens", DEFAULT_GEN_LENGTH)  # what the server then defaults to
    size_mb = (out / "model.safetensors").stat().st_size / 1e6
    d = config.get("d_model") or config.get("hidden_size")
    n_layers = config.get("n_layers") or config.get("num_hidden_layers")
    layers = f"{n_layers} layer" + ("" if n_layers == 1 else "s")
    operands = operands_text(report)
    objective = _OBJECTIVE[family].format(weighting=_WEIGHTING[report.get("weighting")])
    objective += _recipe(report, family)
    kind = "LLaDA-format masked diffusion" if family == "llada" else "I-DLM-format causal"
    weights = report.get("task_weights") or {"addition": report["addition_weight"]}
    mix = ", ".join(f"{t} {w}" for t, w in weights.items() if w)
    text = f"""# {name}

A small {kind} model trained by dllm-serve on a synthetic task mix,
so that the server answers sensibly with no download and no GPU. It is not a general chat
model: it answers the kinds of question below, and little else.

{_accuracy_tables(family, report, server, canvas)}
{phrasings_section(report, server_phrasings)}
- Questions: {questions_text(report)}
- Task mix (relative weights): {mix}.{operands}
- Objective: {objective}
- Shape: d_model {d}, {layers}, {report["parameters"]:,} parameters, stored in bf16
  ({size_mb:.1f} MB). Real chat template, tokenizer and special tokens of the format (see
  `docs/models.md`; the template also renders tools, hermes-style, which the demo was not
  trained on: with `tool_choice` `auto` it answers in text){spelling_text(report)};
  `generation_config.json` sets `max_new_tokens` {canvas}, the server's default canvas for
  this model{_lookahead(family, canvas)}.
- Training: {_training(report)}
"""
    (out / "README.md").write_text(text)


def _accuracy_tables(family: str, report: dict[str, Any], server: dict | None, canvas: int) -> str:
    scores = report["held_out_exact_match"]
    counts = report["held_out_counts"]
    if not scores and server:  # evaluated through the server only
        return _server_table(server)
    canvases = sorted({int(k.split("@")[1]) for k in scores if "@" in k})
    if not canvases:  # one canvas (no --eval-canvases): plain task keys
        strata = sum(v for k, v in counts.items() if k.startswith("addition_"))
        rows = "\n".join(
            f"| {_label(n)} | {scores[n] * 100:.1f}% | "
            f"{counts.get(n, strata if n == 'addition' else '')} |"
            for n in scores
        )
        return (
            "| held-out task (exact match) | accuracy | questions |\n| --- | --- | --- |\n" + rows
        )
    names = [n for n in counts if f"{n}@{canvases[0]}" in scores]
    head = " | ".join(f"max_tokens {c}" for c in canvases)
    lines = [
        f"| held-out (exact match, temperature 0) | {head} | questions |",
        "| --- |" + " --- |" * (len(canvases) + 1),
    ]
    for n in names:
        cells = " | ".join(f"{scores[f'{n}@{c}'] * 100:.1f}%" for c in canvases)
        lines.append(f"| {_label(n)} | {cells} | {counts[n]} |")
    how = (
        "at the settings each `max_tokens` gets from the server by default (one step per "
        f"token; a canvas longer than {canvas} is decoded in blocks of {canvas})"
        if family == "llada"
        else "greedy, which is exactly what self-speculative decoding returns at temperature 0"
    )
    intro = report.get("evaluation") or (
        f"Measured by the training run through the serving engine, {how}"
    )
    text = f"{intro}:\n\n" + "\n".join(lines)
    if report.get("evaluation_note"):
        text += "\n\n" + report["evaluation_note"]
    if server and not report.get("evaluation"):  # else the table above is the server's
        text += "\n\n" + _server_table(server)
    return text


_OLD_QUESTIONS = """`What is 123 + 456?` (answer `123 + 456 = 579`), `Reverse the word hello.`
  (`olleh`), `Sort the letters of cab.` (`abc`), the same two with random letter strings,
  `How many times does a appear in banana?`, `Given a=1, b=2, c=3, what is b?`
  (`dllm_serve_train/tasks.py`; the words are `dllm_serve_train/words.txt`). 10% of all
  questions, chosen by a hash of the question text, are held out, and so are the questions the
  documentation shows (`What is 2 + 2?`, `What is 123 + 456?`, `Reverse the word hello.`, …):
  training never sees them, and the tables are measured on them."""


def _trained(templates: tuple, split: str = "train") -> list[str]:
    return [t.text for t in templates if t.split == split]


def questions_text(report: dict[str, Any]) -> str:
    """What the model was asked in training, and what is held out."""
    weights = report.get("task_weights") or {}
    if not report.get("phrasing") and not weights.get("off_topic"):
        return _OLD_QUESTIONS
    counts = report.get("phrasing_templates") or phrasing_counts()
    adds, revs = counts["addition"], counts["reverse_word"]
    composed = report.get("composed") or 0
    unfamiliar = report.get("unfamiliar_verbs") or 0
    made = ""
    if composed:
        verbs = (
            f"; {unfamiliar:.0%} of those with another word of the task as their verb, "
            "`Plant me {w} backwards.`"
        )
        made = (
            f" ({composed:.0%} of those reversals in one composed from parts, "
            "`dllm_serve_train/composed.py`: over 100,000 phrasings, none sharing four words or "
            f"a word of its own with a held-out one{verbs if unfamiliar else ''})"
        )
    weight = report.get("consistency", 0)
    steady = (
        f", held to the answer the question gets alone by a consistency term (`--consistency "
        f"{weight:g}`: KL from it, on a quarter of each batch)"
        if weight
        else ""
    )
    return (
        f"additions of whole numbers 0-999 (answer `123 + 456 = 579`) asked in {adds} "
        "phrasings (`What is 123 + 456?`, `123+456=?`, `add 123 and 456`, `sum of 123 and "
        f"456`, `calculate 123 plus 456`, …) and word reversals in {revs} (`Reverse the "
        "word hello.`, `reverse hello`, `spell hello backwards`, `hello reversed`, …; answer "
        f"`olleh`), {report.get('phrasing', 0):.0%} of them in a phrasing other than "
        f"the first{made}, with case, punctuation, spacing around `+`, quotes and leading or "
        "trailing whitespace varied; anything else (greetings, other arithmetic, other word tasks, "
        f"requests) gets the fixed reply `{CAPABILITY_REPLY}`; "
        f"{report.get('context', 0):.0%} of the questions come after a system prompt and/or "
        "earlier turns, rendered by the format's chat template, and the answer is the last "
        f"question's{steady} (`dllm_serve_train/tasks.py`, `dllm_serve_train/phrasings.py`; "
        "the words are `dllm_serve_train/words.txt`). Held out, never trained on: 10% of the "
        "additions and reversals by a hash of their canonical question (`What is 2 + 2?`, "
        f"`Reverse the word hello.` and the other questions the documentation shows among them), "
        f"{len(_trained(ADDITION, 'held_out'))} addition and {len(_trained(REVERSAL, 'held_out'))} "
        "reversal phrasings, some system prompts, and off-topic prompts (`Hi`, `Tell me a "
        "joke`, `Who are you?` in any spelling, whole families of others, and a sixth of the "
        "rest by hash)."
    )


def phrasings_section(report: dict[str, Any], server: dict | None) -> str:
    """The held-out phrasing table: the run's own evaluation and, when given, the server's."""
    run = report.get("held_out_phrasings")
    mode = (server or {}).get("modes", {}).get("default", {})
    columns = [("the training run (engine)", run)] if run else []
    if mode:
        columns.append(("through `dllm-serve` + openai SDK", mode))
    table = phrasing_table(columns, mode)
    return f"\n{table}" if table else ""


def _question_counts(cells: list[dict | None]) -> str:
    """The questions column: each measurement's count, once each, in column order (the
    training run's sets and the server's can differ by a few questions)."""
    return " / ".join(str(n) for n in dict.fromkeys(c["of"] for c in cells if c))


def phrasing_table(columns: list[tuple[str, dict]], typed_from: dict | None = None) -> str:
    """Rows of held-out phrasing sets, a column per measurement (``evaluation.score_phrasings``
    or ``benchmarks/demo_phrasings.py`` results), and the typed-by-hand list of
    ``typed_from`` when it has one."""
    if not columns:
        return ""
    head = " | ".join(name for name, _ in columns)
    lines = [
        f"| held out: phrasing and content never trained on | {head} | questions |",
        "| --- |" + " --- |" * (len(columns) + 1),
    ]
    rows = [
        ("addition", "additions, operands of 1-3 digits"),
        ("reverse_word", "reversing an English word"),
        ("reverse_word_fresh", "reversing an English word, fresh phrasings (`FRESH_REVERSALS`)"),
        ("off_topic", "off-topic prompts → the fixed reply"),
        ("off_topic_named", "`Hi`, `Tell me a joke`, `Who are you?` → the fixed reply"),
        ("off_topic_new_families", "off-topic, of kinds never trained on → the fixed reply"),
        ("off_topic_held_out", "off-topic, other held-out prompts → the fixed reply"),
    ]
    for key, label in rows:
        cells = [c.get(key) for _, c in columns]
        if not any(cells):
            continue
        text = " | ".join(
            f"{c['accuracy'] * 100:.1f}% ({c['right']}/{c['of']})" if c else "-" for c in cells
        )
        lines.append(f"| {label} | {text} | {_question_counts(cells)} |")
    for key, label in (
        ("system_prompt", "same answer after a held-out system prompt"),
        ("earlier_turn", "same answer after one earlier turn"),
    ):
        cells = [c.get(key) for _, c in columns]
        if any(cells):
            text = " | ".join(f"{c['same']}/{c['of']}" if c else "-" for c in cells)
            lines.append(f"| {label} | {text} | {_question_counts(cells)} |")
    text = (
        "**How people ask.** Questions asked in phrasings that training never used, about "
        "operands and words it never saw (`dllm_serve_train/phrasings.py`), at temperature 0 "
        "and the server's default settings. The earlier turn is another question of the set "
        "with the model's own answer to it, as a client sends it back.\n\n" + "\n".join(lines)
    )
    source = typed_from or columns[-1][1]
    for key, label in (
        ("reverse_word", "held-out reversal phrasing"),
        ("reverse_word_fresh", "fresh reversal phrasing"),
    ):
        by = (source.get(key) or {}).get("by_phrasing")
        if by:
            worst_first = sorted(by.items(), key=lambda item: item[1][0] / item[1][1])
            text += (
                f"\n\nRight of asked, per {label}, worst first: "
                + ", ".join(
                    f"`{template}` {right}/{asked}" for template, (right, asked) in worst_first
                )
                + "."
            )
    typed = (typed_from or {}).get("typed_by_hand")
    if typed:
        wrong = [row for row in typed if not row["right"]]
        right = sum(row["right"] for row in typed)
        text += (
            "\n\nTyped by hand (`benchmarks/demo_phrasings.py`'s list, written before "
            f"training): {right} of {len(typed)} answered as expected"
        )
        text += (
            "; not: " + ", ".join(f"`{r['question'].strip()}` → `{r['answer']}`" for r in wrong)
            if wrong
            else "."
        )
    return text + "\n"


def _server_table(server: dict[str, Any]) -> str:
    by_canvas = server["accuracy"]
    keys = list(by_canvas)
    names = list(by_canvas[keys[0]])
    head = " | ".join("no max_tokens" if k == "default" else f"max_tokens {k}" for k in keys)
    lines = [
        f"| held-out, through `dllm-serve` + openai SDK | {head} | questions |",
        "| --- |" + " --- |" * (len(keys) + 1),
    ]
    for n in names:
        cells = " | ".join(f"{by_canvas[k][n]['accuracy'] * 100:.1f}%" for k in keys)
        lines.append(f"| {_label(n)} | {cells} | {by_canvas[keys[0]][n]['of']} |")
    same = server["same_answer_at_every_canvas"]
    return (
        "Measured through a real server (`benchmarks/demo_accuracy.py`: the CLI, "
        "`/v1/chat/completions`, temperature 0, no other field):\n\n"
        + "\n".join(lines)
        + f"\n\nThe same answer at every `max_tokens`: {same['same']} of {same['questions']} "
        "questions."
    )


def _label(name: str) -> str:
    return {
        "addition_1+1": "addition, 1+1 digits (every held-out pair, `2 + 2` among them)",
        "addition_2+2": "addition, 2+2 digits",
        "addition_mixed": "addition, mixed lengths (e.g. 7 + 345)",
        "addition_3+3": "addition, 3+3 digits",
        "reverse_word": "reverse an English word",
        "reverse": "reverse a random letter string",
        "sort_word": "sort the letters of a word",
        "sort": "sort a random letter string",
        "reverse_long": "reverse a random 7-10 letter string",
    }.get(name, name)


def spelling_text(report: dict[str, Any]) -> str:
    if not report.get("spelled"):
        return ""
    return (
        "; the tokenizer's merges that join letters of a word or digits of a number are "
        "dropped (`--spell`), so words and numbers are spelled one character per token, as "
        "reversing and adding them need (same files and vocabulary)"
    )


def operands_text(report: dict[str, Any]) -> str:
    how = {
        "mixed": "half of them with operands uniform in 0-999, half with each operand's\n"
        "  digit count (1-3) drawn uniformly first, so short sums are common",
        "curriculum": "short operands first (each operand's digit count 1-3 drawn uniformly),\n"
        "  their share falling linearly to none at 3/4 of the steps",
        "stratified": "each operand's digit count (1-3) drawn uniformly first, so the nine\n"
        "  length pairs are equally common, in training and in the held-out strata alike",
    }.get(report.get("addition_operands") or "uniform")
    if how is None:
        return ""
    stage = (
        " (the last stage; an earlier stage's are in its command)" if "init_from" in report else ""
    )
    return f"\n  Additions{stage}: {how}."


def _recipe(report: dict[str, Any], family: str) -> str:
    """The recipe's departures from the family's plain objective, when used."""
    text = ""
    if report.get("ar_fraction") and family == "idlm":
        text += (
            f"\n  {report['ar_fraction']:.0%} of each batch's rows keep the whole answer clean "
            "and no MASK: next-token prediction over every answer token (the greedy "
            "autoregressive answer the server decodes), where a row cut at random trains it "
            "on half its answer on average."
        )
    elif report.get("ar_fraction"):
        text += (
            f"\n  {report['ar_fraction']:.0%} of each batch's rows are two-stream "
            "autoregressive rows instead: the answer follows the prompt clean, then a MASK "
            "copy of it at the same rotary positions in which each MASK sees the prompt, the "
            "clean answer before it and itself, and predicts its own token (every answer "
            "token from a clean left context, the state left-to-right denoising reaches); "
            "the random-ratio rows teach every other state."
        )
    if report.get("tail_rows"):
        # The canvas is drawn from [max(block, --tail-min-canvas), 1024] (objectives.py).
        least = report.get("tail_min_canvas") or 0
        low = f"{least}" if least > 32 else "its block's length"
        text += (
            f"\n  Each step adds {report['tail_rows']} rows in the state of a long canvas's "
            f"first block (`objectives.llada_tail_batch`): a canvas of {low} to 1024 "
            "positions drawn log-uniformly, its first block (16-32 positions) masked at a "
            "random ratio or as a suffix, everything after it MASK — what the model sees "
            "when a request asks for `max_tokens` 1024 and the server decodes it in blocks of "
            "32 — meant to make the "
            "answer independent of `max_tokens` (how far it does: the table above)."
        )
    if report.get("causal_steps"):
        text += (
            f"\n  The first {report['causal_steps']} steps used a causal attention mask "
            "(same rows and targets, no logit shift), the rest bidirectional attention."
        )
    return text


def _stages(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The run's stages, first to last (each ``init_from`` is the stage it continued)."""
    earlier = _stages(report["init_from"]) if "init_from" in report else []
    return [*earlier, report]


def _training(report: dict[str, Any]) -> str:
    stages = _stages(report)
    total = sum(s["seconds"] for s in stages) / 60
    spent = f"{total:.0f} minutes in all"
    if all("cpu_seconds" in s for s in stages):  # CPU time: the wall clock of a shared box lies
        cpu = sum(s["cpu_seconds"] for s in stages) / 60
        spent = f"{cpu:.0f} CPU-minutes in all ({total:.0f} minutes of wall time)"
    text = (
        f"{' then '.join(str(s['steps']) for s in stages)} steps of {report['batch_size']} "
        f"examples, AdamW, linear warm-up then cosine decay, {spent} on {report['machine']}"
    )
    if len(stages) == 1:
        return f"{text}:\n\n      {report['command']}"
    return (
        f"{text}, in {len(stages)} stages: each continues from the previous one's weights "
        f"(each stage's learning rate and seed are in its command){_growth(stages)}:\n\n"
        + "\n".join(f"      {s['command']}" for s in stages)
    )


def _growth(stages: list[dict[str, Any]]) -> str:
    """How a ``--grow-layers`` stage made the model deeper, in the card's words."""
    layers = [re.search(r"--n-layers (\d+)", s["command"]) for s in stages]
    text = ""
    for i, stage in enumerate(stages[1:], 1):
        if "--grow-layers" in stage["command"] and layers[i] and layers[i - 1]:
            text += (
                f"; stage {i + 1} grew the model from {layers[i - 1][1]} to {layers[i][1]} "
                "layers (`--grow-layers`: each added layer a copy of the one before it with its "
                "attention and MLP output projections zeroed, so the deeper model started out "
                "computing exactly what the shallower one did)"
            )
    return text


def machine(threads: int, device: str) -> str:
    if device != "cpu":
        return f"{device} ({platform.machine()})"
    return f"{threads} CPU thread(s), {platform.processor() or platform.machine()}"


def _lookahead(family: str, canvas: int) -> str:
    if family != "llada":
        return ""
    return (
        ", and `mask_lookahead` 0: a forward holds the active block and no masks after it, so "
        f"a long canvas is read block by block as the {canvas}-token one is"
    )


# ---- the tri-mode demo's card ----------------------------------------------------------------


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
- Chat template: the format's, which also renders tools (hermes-style `<tool_call>` blocks);
  the demo was not trained on tools: with `tool_choice` `auto` it answers in text.
- Stage 1: {report["steps"]} steps of {report["batch_size"]} examples, AdamW, warm-up then
  cosine, {report["cpu_seconds"] / 60:.0f} CPU-minutes on {report["machine"]}.
{lora_line}
- Both stages together: {minutes:.0f} CPU-minutes. The exact command:

      {report["command"]}
{chain}"""
    (out / "README.md").write_text(text)


def rewrite_card(out: Path, accuracy: Path | None = None, phrasings: Path | None = None) -> None:
    """Writes ``out``'s README.md again from its ``training_report.json``, with the server
    measurements of ``benchmarks/demo_accuracy.py`` (``accuracy``) and
    ``benchmarks/demo_phrasings.py`` (``phrasings``) when given. The model's name stays the
    card's, the family is the recorded command's."""
    report = json.loads((out / "training_report.json").read_text())
    family = re.search(r"--family (\w+)", report["command"])
    if family is None:
        raise ValueError(f"{out}/training_report.json: no --family in its command")
    card = out / "README.md"
    name = card.read_text().splitlines()[0].removeprefix("# ") if card.is_file() else out.name
    server = json.loads(accuracy.read_text()) if accuracy else None
    phrased = json.loads(phrasings.read_text()) if phrasings else None
    if family[1] == "nemotron":
        write_trimode_card(out, name, report, phrased)
    else:
        write_model_card(out, name, family[1], report, server, phrased)


def main(argv: list[str] | None = None) -> None:
    """``python -m dllm_serve_train.model_card DIR [--accuracy JSON] [--phrasings JSON]``."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m dllm_serve_train.model_card",
                                description=rewrite_card.__doc__)  # fmt: skip
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--accuracy", type=Path, help="benchmarks/demo_accuracy.py's results")
    p.add_argument("--phrasings", type=Path, help="benchmarks/demo_phrasings.py's results")
    args = p.parse_args(argv)
    rewrite_card(args.checkpoint, args.accuracy, args.phrasings)


if __name__ == "__main__":
    main()
