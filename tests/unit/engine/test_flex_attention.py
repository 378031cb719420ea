"""FlexAttention over the paged pool on CPU (the compiled kernel, the code path a GPU runs).

The rows of every forward the offline LLM runs for 16 requests of different prompt lengths are
recorded, in each family and mode, and replayed through a FlexAttention runner and an SDPA one:
the same logits, and flex forwards that never build a ``[q, S]`` mask nor copy cached K/V (a
dispatch mode records every tensor the forward creates; on the SDPA path the same recorder
finds the per-layer gathers, so it can fail). Logits, not tokens, are compared: the tiny random
models are nearly uniform, and 1e-7 of kernel rounding may pick another of two tied tokens."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _disable_current_modes,
    _get_current_dispatch_mode_stack,
)

from dllm_serve.config import EngineConfig
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.decoding.protocol import RowSpec
from dllm_serve.engine.model_runner import ModelRunner
from dllm_serve.llm import LLM
from dllm_serve.models import layers
from dllm_serve.models.kv_pool import PAGE_SIZE
from dllm_serve.models.loader import LoadedModel, load_model
from dllm_serve_train.tiny_checkpoints import write_tiny

# 16 requests of different prompt lengths (3 to 33 tokens).
PROMPTS = [[(7 * i + 2 * j) % 50 + 5 for j in range(3 + 2 * i)] for i in range(16)]

CASES = {
    "llada, no cache (flat keys)": ("llada", {"gen_length": 16, "block_length": 8, "steps": 16},
                                    {}),
    "llada + prefix cache": ("llada", {"gen_length": 16, "block_length": 8, "steps": 16},
                             {"kv_cache": "prefix"}),
    "idlm (ISD)": ("idlm", {"gen_length": 12}, {"isd_stride": 4}),
    "sdar": ("sdar", {"gen_length": 12}, {}),
    "llada2": ("llada2", {"gen_length": 12}, {}),
    "fastdllm": ("fastdllm", {"gen_length": 12}, {}),
    "tri-mode linear_spec": ("nemotron", {"gen_length": 12, "decoding_mode": "linear_spec"}, {}),
    "tri-mode diffusion": ("nemotron", {"gen_length": 12, "decoding_mode": "diffusion"}, {}),
    "tri-mode ar": ("nemotron", {"gen_length": 12, "decoding_mode": "ar"}, {}),
}  # fmt: skip


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoadedModel]:
    root = Path(tmp_path_factory.mktemp("flex"))
    families = {family for family, _, _ in CASES.values()}
    out = {"llada": load_model("tiny-llada", device="cpu", dtype="float32")}
    for family in families - {"llada"}:
        out[family] = load_model(str(write_tiny(family, root / family)), dtype="float32")
    return out


def record_rows(loaded: LoadedModel, params: dict[str, Any], engine: dict[str, Any]) -> list:
    """The rows of every forward the engine runs for the 16 requests (as built: their pages
    taken), on the SDPA path."""
    config = EngineConfig(attention_backend="sdpa", max_waiting_requests=64, **engine)
    seen: list[list[RowSpec]] = []
    real_build = ModelRunner.build

    def build(self: ModelRunner, rows: list[RowSpec]) -> Any:
        out = real_build(self, rows)
        seen.append(copy.deepcopy(rows))
        return out

    mp = pytest.MonkeyPatch()
    mp.setattr(ModelRunner, "build", build)
    try:
        with LLM.from_loaded(loaded, config) as llm:
            llm.generate_ids(PROMPTS, DecodingParams(**params))
    finally:
        mp.undo()
    return seen


def replay(
    loaded: LoadedModel, steps: list[list[RowSpec]], backend: str
) -> tuple[list[torch.Tensor], list[str]]:
    """Every recorded forward, in order, through a fresh runner of ``backend``: the logits of
    each, and the problems the recorder found in any."""
    pages = [page for rows in steps for r in rows if r.kv is not None for page in r.kv.pages]
    # One pool size for every case (whole 2048s): the compiled kernel is specialised to the
    # key length, so the cases of one model share their compiles.
    slots = -(-(1 + max(pages)) * PAGE_SIZE // 2048) * 2048 if pages else 0
    runner = ModelRunner(loaded.model, torch.device("cpu"), kv_slots=slots, attention=backend)
    problems: list[str] = []
    current: list[RowSpec] = []
    real_attend = layers.flex_attend

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Any) -> torch.Tensor:
        # The kernel runs compiled, outside the recorder (what happens inside it is the
        # kernel's business); what it is handed is checked: the pool's own K/V, not copies.
        mode = _current_recorder()
        if plan.pool and mode is not None:
            for tensor in (k, v):
                if tensor.untyped_storage().data_ptr() not in mode.pool_storages:
                    mode.problems.append("flex_attend: handed a copy of the cached K/V")
        with _disable_current_modes():
            return real_attend(q, k, v, plan)

    real_attention = layers.Attention.forward_flat

    def attention(self: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        # Every attention layer of the forward under the recorder (the MLPs' own tensors, such
        # as MoE routing masks over tokens × experts, are not attention masks).
        with Recorder(runner.pool, current) as recorder:
            out = real_attention(self, *args, **kwargs)
        problems.extend(recorder.problems)
        return out

    logits = []
    mp = pytest.MonkeyPatch()
    mp.setattr(layers, "flex_attend", attend)
    mp.setattr(layers.Attention, "forward_flat", attention)
    try:
        with torch.inference_mode():
            for rows in steps:
                current = copy.deepcopy(rows)
                with Recorder(runner.pool, current) as recorder:  # the batch and its masks
                    batch, _ = runner.build(current)
                problems.extend(f"build: {p}" for p in recorder.problems)
                logits.append(runner.forward(batch).clone())  # the flat requested positions
    finally:
        mp.undo()
    return logits, problems


class Recorder(TorchDispatchMode):
    """Every op of a batch's build or of an attention layer: a boolean or additive mask with
    ``q × S`` or more elements for one row (``q`` its queries, ``S`` its keys: prefix and own
    tokens), or an op that reads the pool's K/V into a new tensor (anything but writing it
    and viewing it)."""

    VIEWS = frozenset(
        {"view", "reshape", "_unsafe_view", "select", "slice", "transpose", "permute",
         "unsqueeze", "squeeze", "expand", "alias", "as_strided", "t", "detach", "split",
         "split_with_sizes", "unbind", "index_copy_", "index_copy"}
    )  # fmt: skip

    def __init__(self, pool: Any, rows: list[RowSpec]) -> None:
        super().__init__()
        self.pool_storages = (
            set()
            if pool is None
            else {pool.k.untyped_storage().data_ptr(), pool.v.untyped_storage().data_ptr()}
        )
        self.threshold = min(len(r.tokens) * (r.start + len(r.tokens)) for r in rows)
        self.problems: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        flat = [
            o
            for o in (out if isinstance(out, tuple | list) else (out,))
            if isinstance(o, torch.Tensor)
        ]
        for tensor in flat:
            if tensor.dtype == torch.bool and tensor.numel() >= self.threshold:
                self.problems.append(f"{name}: a boolean mask of {tuple(tensor.shape)}")
            elif (
                tensor.is_floating_point()
                and name in ("masked_fill", "where", "full", "full_like", "fill", "fill_")
                and tensor.numel() >= self.threshold
                and bool(torch.isinf(tensor).any())
            ):
                self.problems.append(f"{name}: an additive mask of {tuple(tensor.shape)}")
        if self.pool_storages and name not in self.VIEWS:
            for arg in _tensors(args):
                if arg.untyped_storage().data_ptr() in self.pool_storages:
                    self.problems.append(f"{name}: reads the pool's K/V into a new tensor")
                    break
        return out


def _current_recorder() -> Recorder | None:
    return next((m for m in _get_current_dispatch_mode_stack() if isinstance(m, Recorder)), None)


def _tensors(args: Any) -> Iterator[torch.Tensor]:
    for arg in args:
        if isinstance(arg, torch.Tensor):
            yield arg
        elif isinstance(arg, tuple | list):
            yield from _tensors(arg)


@contextmanager
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("case", list(CASES))
def test_flex_builds_no_mask_copies_no_kv_and_gives_the_sdpa_logits(
    models: dict[str, LoadedModel], case: str
) -> None:
    family, params, engine = CASES[case]
    loaded = models[family]
    with one_thread():
        steps = record_rows(loaded, params, engine)
        flex, flex_problems = replay(loaded, steps, "flex")
        sdpa, sdpa_problems = replay(loaded, steps, "sdpa")
    assert len(steps) >= 2 and any(len(rows) >= 8 for rows in steps)
    for step, (a, b) in enumerate(zip(flex, sdpa, strict=True)):
        assert (a - b).abs().max().item() <= 1e-5, step
    assert flex_problems == []
    # The recorder has teeth: with a KV cache the SDPA path gathers cached keys (and builds
    # masks where prefixes differ).
    if "no cache" not in case:
        assert any("reads the pool" in p for p in sdpa_problems), sdpa_problems[:5]
