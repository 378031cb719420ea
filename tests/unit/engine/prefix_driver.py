"""Drive an :class:`AsyncEngine` by hand (no engine thread) and count what it does: the
prefix-reuse tests' harness."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace

from dllm_serve.config import EngineConfig
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.engine.engine import AsyncEngine
from dllm_serve.engine.outputs import IncrementalDetokenizer, NullObserver, RequestOutput
from dllm_serve.engine.request import Request
from dllm_serve.models.loader import LoadedModel


@dataclass
class Counts(NullObserver):
    """Forward tokens and the prefix cache's queries and hits, as the metrics count them."""

    forward_tokens: int = 0
    queries: int = 0
    hits: int = 0
    finished: list[RequestOutput] = field(default_factory=list)

    def on_forward(self, rows: int, tokens: int, model_seconds: float, graphed: bool) -> None:
        self.forward_tokens += tokens

    def on_prefix_cache(self, queried: int, hit: int) -> None:
        self.queries += queried
        self.hits += hit

    def on_finished(self, output: RequestOutput, seconds_since_arrival: float) -> None:
        self.finished.append(output)


def hand_engine(loaded: LoadedModel, **config: object) -> tuple[AsyncEngine, Counts]:
    counts = Counts()
    engine = AsyncEngine(loaded, EngineConfig(**config), counts)  # type: ignore[arg-type]
    engine._thread = SimpleNamespace(is_alive=lambda: True)  # type: ignore[assignment]
    return engine, counts


def request(
    engine: AsyncEngine, name: str, prompt: Sequence[int], params: DecodingParams
) -> Request:
    outs: list[RequestOutput] = []
    return Request(
        request_id=name,
        prompt_ids=list(prompt),
        params=params,
        sink=outs.append,
        detokenizer=IncrementalDetokenizer(engine._decode),
    )


def run(
    engine: AsyncEngine,
    prompts: Sequence[Sequence[int]],
    params: DecodingParams | Sequence[DecodingParams],
    *,
    prefix: str = "r",
    abort: dict[str, int] | None = None,
    each_step: object = None,
) -> list[Request]:
    """Submit ``prompts`` together and step the engine until every one has ended; ``abort``:
    request name → the engine step (counted from this call) before which it is aborted;
    ``each_step``: a callable run after every step (invariant checks)."""
    if isinstance(params, DecodingParams):
        params = [params] * len(prompts)
    requests = [
        request(engine, f"{prefix}{i}", p, q)
        for i, (p, q) in enumerate(zip(prompts, params, strict=True))
    ]
    engine.inbox.requests.extend(requests)
    step = 0
    while engine.scheduler.running or engine.scheduler.waiting or engine.inbox.requests:
        for name, at in (abort or {}).items():
            if at == step:
                engine.abort(name)
        engine.step()
        if callable(each_step):
            each_step()
        step += 1
    return requests


def answers(requests: Sequence[Request]) -> list[list[int]]:
    out = []
    for r in requests:
        assert r.state is not None
        out.append(r.state.answer_tokens())
    return out
