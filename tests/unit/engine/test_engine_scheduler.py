"""Scheduler: admission limits and grouping of rows into forwards."""

from __future__ import annotations

from dllm_serve.config import EngineConfig
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.engine.outputs import IncrementalDetokenizer
from dllm_serve.engine.request import Request
from dllm_serve.engine.scheduler import Scheduler


def request(name: str, prompt: int, canvas: int, single: bool = False) -> Request:
    return Request(
        request_id=name,
        prompt_ids=[1] * prompt,
        params=DecodingParams(gen_length=canvas, steps=canvas, force_single_batch=single),
        sink=lambda out: None,
        detokenizer=IncrementalDetokenizer(lambda ids: ""),
    )


def test_admit_respects_running_limit_in_fifo_order() -> None:
    sched = Scheduler(EngineConfig(max_running_requests=2))
    sched.waiting.extend(request(n, 4, 8) for n in "abc")
    for r in sched.admit():
        sched.run(r)
    assert [r.request_id for r in sched.running] == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c"]
    sched.remove(sched.running[0])
    for r in sched.admit():
        sched.run(r)
    assert [r.request_id for r in sched.running] == ["b", "c"]


def test_every_running_request_once_per_iteration_within_budget() -> None:
    sched = Scheduler(EngineConfig(max_tokens_per_forward=100))
    sizes = {"a": (10, 30), "b": (2, 8), "c": (5, 15), "d": (20, 44), "e": (1, 3)}
    for name, (p, g) in sizes.items():
        sched.run(request(name, p, g))
    sched.run(request("solo", 2, 8, single=True))
    groups = sched.groups()
    names = [r.request_id for g in groups for r in g]
    assert sorted(names) == sorted([*sizes, "solo"])
    assert ["solo"] in [[r.request_id for r in g] for g in groups]
    for group in groups:  # real tokens (forwards are flat: no padding) within the budget
        assert len(group) == 1 or sum(r.row_length for r in group) <= 100
        lengths = [r.row_length for r in group]
        assert lengths == sorted(lengths)  # rows of one shape sit together


def test_a_row_longer_than_the_budget_still_runs_alone() -> None:
    sched = Scheduler(EngineConfig(max_tokens_per_forward=10))
    sched.run(request("big", 10, 40))
    sched.run(request("small", 1, 1))
    assert sorted(len(g) for g in sched.groups()) == [1, 1]


def test_prefill_rows_get_forwards_of_their_own() -> None:
    class Phase:
        def __init__(self, prefill: bool, length: int) -> None:
            self.is_prefill, self.row_length = prefill, length

    sched = Scheduler(EngineConfig(max_tokens_per_forward=1000))
    rows = {"p1": (True, 300), "d1": (False, 7), "d2": (False, 7), "p2": (True, 40)}
    for name, (prefill, length) in rows.items():
        req = request(name, 1, 1)
        req.state = Phase(prefill, length)  # type: ignore[assignment]
        sched.run(req)
    names = [[r.request_id for r in g] for g in sched.groups()]
    assert names == [["p2", "p1"], ["d1", "d2"]]  # prefill forward first, decode rows apart
