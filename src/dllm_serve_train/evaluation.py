"""Held-out evaluation of a trained demo model through the serving engine, at the settings a
request gets from the server."""

from __future__ import annotations

from pathlib import Path

from dllm_serve.api.parameters import decoding_params
from dllm_serve.api.protocol import ChatCompletionRequest
from dllm_serve.config import EngineConfig
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.llm import LLM
from dllm_serve_train.tasks import (
    PHRASING_SETS,
    STRATA,
    TASKS,
    Example,
    held_out_additions,
    held_out_phrasings,
    held_out_set,
    held_out_system_prompts,
)

N_ADDITION, N_OTHER = 1000, 100  # held-out questions in the final evaluation
N_PHRASED = 200  # held-out questions per set asked in held-out phrasings


def evaluate(
    out: Path,
    family: str,
    device: str = "cpu",
    canvas: int = 32,
    n_addition: int = N_ADDITION,
    n_other: int = N_OTHER,
    tasks: tuple[str, ...] = tuple(TASKS),
    canvases: tuple[int, ...] = (),
) -> dict[str, float]:
    """Held-out exact match at temperature 0 through the serving engine.

    With ``canvases`` empty, the model's ``canvas`` at the server's default settings; else one
    score per canvas length, keyed ``task@canvas``, each at the settings a request of that
    ``max_tokens`` gets from the server (a canvas longer than ``canvas`` in blocks of about
    ``canvas``). Addition is scored per operand stratum (:data:`STRATA`, ``n_addition``
    questions split over them) as ``addition_1+1`` etc., and overall. LLaDA: one step per
    token. I-DLM: one token per step (block 1), greedy autoregressive decoding — what exact
    self-speculative verification returns at temperature 0.
    """
    scores: dict[str, float] = {}
    config = EngineConfig(max_running_requests=64, max_waiting_requests=1 << 20)
    sets: dict[str, list] = {}
    for task in tasks:
        if task == "addition":
            for name in STRATA:
                sets[f"addition_{name}"] = held_out_additions(name, n_addition // len(STRATA))
        else:
            sets[task] = held_out_set(n_other, task=task)
    with LLM(str(out), device=device, dtype="float32", engine_config=config) as llm:
        for length in canvases or (canvas,):
            suffix = f"@{length}" if canvases else ""
            params = server_params(length, canvas)
            right_adds = n_adds = 0
            for name, exs in sets.items():
                outs = llm.generate([e.messages() for e in exs], params)
                right = sum(o.text.strip() == e.answer for o, e in zip(outs, exs, strict=True))
                scores[name + suffix] = round(right / len(exs), 4)
                if name.startswith("addition_"):
                    right_adds, n_adds = right_adds + right, n_adds + len(exs)
            if n_adds:
                scores["addition" + suffix] = round(right_adds / n_adds, 4)
    return scores


def server_params(length: int | None, trained: int = 32) -> DecodingParams:
    """The decoding a chat request with ``max_tokens`` = ``length`` (None: not set) gets from
    the server for a model trained on ``trained``-token canvases (its default canvas and
    block): the API's own rules (``api/request_params.py``), so the evaluation measures what
    users get. Self-speculative models ignore the canvas fields."""
    body: dict = {"messages": [{"role": "user", "content": "?"}]}
    if length is not None:
        body["max_tokens"] = length
    return decoding_params(ChatCompletionRequest.model_validate(body), trained, trained)


def phrasing_sets(n: int = N_PHRASED) -> dict[str, list[Example]]:
    """The held-out phrasing sets (``tasks.held_out_phrasings``), ``n`` questions each."""
    return {task: held_out_phrasings(task, n) for task in PHRASING_SETS}


def by_phrasing(exs: list[Example], rights: list[bool]) -> dict[str, list[int]]:
    """[right, asked] per template, in the order the templates first occur: which phrasings
    a model misses, not only how many questions."""
    by: dict[str, list[int]] = {}
    for e, right in zip(exs, rights, strict=True):
        row = by.setdefault(e.template, [0, 0])
        row[0] += right
        row[1] += 1
    return by


def score_phrasings(generate, sets: dict[str, list[Example]]) -> dict:
    """Exact match per held-out phrasing set, and how many answers a held-out system prompt
    or one earlier turn changes. ``generate`` maps a list of conversations to answer texts.

    The earlier turn is the next question of the pooled sets with the model's own answer to
    it, as a chat client would send it back; each question is asked alone, after a system
    prompt (held-out ones in turn) and after that turn, and the three answers compared; each
    answer a context changed is listed with it (``changed``).
    """
    pool = [e for exs in sets.values() for e in exs]
    alone = generate([e.messages() for e in pool])
    scores: dict = {}
    start = 0
    for name, exs in sets.items():
        got = alone[start : start + len(exs)]
        rights = [a.strip() == e.answer for a, e in zip(got, exs, strict=True)]
        right = sum(rights)
        scores[name] = {"right": right, "of": len(exs), "accuracy": round(right / len(exs), 4)}
        if name in ("addition", "reverse_word"):
            scores[name]["by_phrasing"] = by_phrasing(exs, rights)
        start += len(exs)
    systems = held_out_system_prompts()
    with_system = [
        [{"role": "system", "content": systems[i % len(systems)]}, *e.messages()]
        for i, e in enumerate(pool)
    ]
    with_turn = []
    for i, e in enumerate(pool):
        before = pool[(i + 1) % len(pool)]
        turn = [{"role": "user", "content": before.question},
                {"role": "assistant", "content": alone[(i + 1) % len(pool)]}]  # fmt: skip
        with_turn.append([*turn, *e.messages()])
    for name, conversations in (("system_prompt", with_system), ("earlier_turn", with_turn)):
        answers = generate(conversations)
        same = sum(a == b for a, b in zip(answers, alone, strict=True))
        right = sum(a.strip() == e.answer for a, e in zip(answers, pool, strict=True))
        # Each changed answer beside its context, so that what a context moves can be read.
        changed = [
            {
                "context": c[:-1],
                "question": e.question,
                "expected": e.answer,
                "alone": before,
                "answer": after,
            }
            for c, e, before, after in zip(conversations, pool, alone, answers, strict=True)
            if before != after
        ]
        scores[name] = {"same": same, "right": right, "of": len(pool), "changed": changed}
    return scores


def evaluate_phrasings(
    out: Path, device: str = "cpu", canvas: int = 32, n: int = N_PHRASED
) -> dict:
    """:func:`score_phrasings` through the serving engine at the server's default settings."""
    config = EngineConfig(max_running_requests=64, max_waiting_requests=1 << 20)
    params = server_params(None, canvas)
    with LLM(str(out), device=device, dtype="float32", engine_config=config) as llm:
        return score_phrasings(
            lambda conversations: [o.text for o in llm.generate(conversations, params)],
            phrasing_sets(n),
        )
