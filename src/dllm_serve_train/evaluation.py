"""Held-out evaluation of a trained demo model through the serving engine, at the settings a
request gets from the server."""

from __future__ import annotations

from pathlib import Path

from dllm_serve.api.protocol import ChatCompletionRequest
from dllm_serve.api.rules import decoding_params
from dllm_serve.config import EngineConfig
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.llm import LLM
from dllm_serve_train.tasks import STRATA, TASKS, held_out_additions, held_out_set

N_ADDITION, N_OTHER = 1000, 100  # held-out questions in the final evaluation


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
                outs = llm.generate(
                    [[{"role": "user", "content": e.question}] for e in exs], params
                )
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
