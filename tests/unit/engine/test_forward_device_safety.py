"""The forwards keep to the device: every graphed one is capture-safe, checked without a GPU.

A captured region may launch device work only: reading a device value on the host (``.item()``,
``nonzero``, boolean indexing, ``tolist``) fails the capture, and so does copying host memory
to the device inside it (``torch.tensor(list, device=...)``, a CPU index tensor) — and either
would waste a rare GPU window. On CPU the static forwards run uncaptured, where neither shows.
So here each decoding mode's graphed steps are first recorded on CPU through the engine (the
rows of every graph shape it would capture), then replayed on the **meta device**: tensors
there have shapes and no data, so any op that needs a value raises, and a dispatch mode fails
any op handed a tensor of another device (a host tensor that a GPU forward would copy over).

The eager forwards (prefills, refreshes, block writes, steps without a cache) are held to the
same rule: a step's only host→device copy is the flat batch's, built before the forward
(``BatchPacker``), and its only read-back is the sampler's, after it — MoE layers included, whose
experts run as grouped GEMMs in bf16 (their one-by-one fallback reads the counts back).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from device_guard import DeviceOnly
from test_engine_cuda_graphs import CASES as GRAPH_CASES
from test_engine_cuda_graphs import PROMPTS, StaticRunner, tiny_models

from dllm_serve.config import EngineConfig
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.decoding.protocol import RowSpec
from dllm_serve.engine import engine as engine_module
from dllm_serve.engine.graphs import MAX_Q, GraphKey, GraphRunner
from dllm_serve.engine.model_runner import ModelRunner
from dllm_serve.llm import LLM
from dllm_serve.models.kv_pool import PAGE_SIZE, KVPool
from dllm_serve.models.loader import LoadedModel, load_model
from dllm_serve.models.lora import weight_view_hooks
from dllm_serve_train.tiny_checkpoints import write_tiny

META = torch.device("meta")
pytestmark = pytest.mark.usefixtures("one_thread")


def record_graphed_steps(
    loaded: LoadedModel, params: DecodingParams, **engine: object
) -> dict[GraphKey, tuple[list[RowSpec], int]]:
    """The rows and logits width of the first step of each graph shape the engine takes."""
    seen: dict[GraphKey, tuple[list[RowSpec], int]] = {}
    static_for, run = GraphRunner.static_for, GraphRunner.run

    def recording_static_for(self: GraphRunner, key: GraphKey, rows: list[RowSpec]) -> Any:
        seen.setdefault(key, (copy.deepcopy(rows), 0))
        return static_for(self, key, rows)

    def recording_run(self: GraphRunner, static: Any, rows: int, width: int) -> Any:
        recorded, known = seen[static.key]
        if not known:
            seen[static.key] = (recorded, width)
        return run(self, static, rows, width)

    mp = pytest.MonkeyPatch()
    mp.setattr(engine_module, "ModelRunner", StaticRunner)
    mp.setattr(GraphRunner, "static_for", recording_static_for)
    mp.setattr(GraphRunner, "run", recording_run)
    try:
        config = EngineConfig(max_waiting_requests=64, cuda_graph=True, **engine)  # type: ignore[arg-type]
        with LLM.from_loaded(loaded, config) as llm:
            llm.generate(PROMPTS, params)
            max_rows = llm.engine.runner.graphs.max_rows
    finally:
        mp.undo()
    assert seen, "no step took a static forward: the test would be vacuous"
    assert all(key.rows <= max_rows for key in seen)
    return seen


def replay_on_meta(loaded: LoadedModel, steps: dict[GraphKey, tuple[list[RowSpec], int]]) -> int:
    """Each recorded step through a GraphRunner of a data-less copy of the model; ops run."""
    model = copy.deepcopy(loaded.model).to(META)
    cfg = model.config
    pages = [page for rows, _ in steps.values() for r in rows for page in r.kv.pages]
    slots = (1 + max(pages)) * PAGE_SIZE
    pool = KVPool(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, slots, device=META,
                  scratch_slots=MAX_Q)  # fmt: skip
    graphs = GraphRunner(model, pool, META, weight_view_hooks(model), max_rows=128, capture=False)
    ops = 0
    # no_grad, not inference_mode: meta tensors refuse the draft hook's weight swap
    # (``param.data = merged``) between inference and normal tensors; CPU and CUDA allow it.
    with torch.no_grad():
        for key, (rows, width) in steps.items():
            static = graphs.static_for(key, rows)  # fills the inputs: the copy before replay
            assert static is not None
            guard = DeviceOnly(META)
            with guard:
                logits = graphs.run(static, len(rows), width)
            assert logits.device == META
            assert logits.shape == (len(rows), width, cfg.vocab_size)
            ops += guard.ops
    return ops


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoadedModel]:
    return tiny_models(Path(tmp_path_factory.mktemp("capture-safety")), "cpu")


# Every decoding mode the CPU and GPU graph tests run (docs/architecture.md, "CUDA graphs").
CASES = GRAPH_CASES


@pytest.mark.parametrize("case", list(CASES))
def test_graphed_steps_are_capture_safe(models: dict[str, LoadedModel], case: str) -> None:
    family, params, engine = CASES[case]
    steps = record_graphed_steps(models[family], params, **engine)
    assert replay_on_meta(models[family], steps) > 0
    if params.decoding_mode == "linear_spec":  # both weight views: draft and verify rounds
        assert {key.draft for key in steps} == {True, False}


def test_the_guard_catches_a_host_read_and_a_host_copy() -> None:
    """The checks above could not pass vacuously: each hazard fails under them."""
    x = torch.zeros(4, device=META)
    with pytest.raises(AssertionError, match="_local_scalar_dense"), DeviceOnly(META):
        x.sum().item()
    with pytest.raises(AssertionError, match=r"aten\.nonzero\.default reads"), DeviceOnly(META):
        torch.ops.aten.nonzero.default(x)
    # Boolean indexing sizes its output from the values: the meta device has none to give.
    with pytest.raises(NotImplementedError, match="nonzero"), DeviceOnly(META):
        x[x > 0]
    with pytest.raises(AssertionError, match="host tensor in device work"), DeviceOnly(META):
        x + torch.ones(4)  # a host tensor handed to a device op
    with pytest.raises(AssertionError, match="host tensor in device work"), DeviceOnly(META):
        x[torch.tensor([0, 2])]  # a host index tensor: copied to the device per call
    # A read that dispatches no op (tolist, numpy) has no data to read on the meta device.
    with pytest.raises(NotImplementedError), DeviceOnly(META):
        x.tolist()
    one = torch.tensor(1.0)
    with DeviceOnly(META) as guard:
        (x * 2 + one).sum()  # device ops and a 0-d scalar pass
    assert guard.ops == 3


def record_eager_steps(
    loaded: LoadedModel, params: DecodingParams, limit: int, **engine: object
) -> list[list[RowSpec]]:
    """The rows of the engine's first ``limit`` forwards, graphs off (as built: their pages
    taken)."""
    seen: list[list[RowSpec]] = []
    build = ModelRunner.build

    def recording_build(self: ModelRunner, rows: list[RowSpec]) -> Any:
        if len(seen) < limit:
            seen.append(copy.deepcopy(rows))
        return build(self, rows)

    mp = pytest.MonkeyPatch()
    mp.setattr(ModelRunner, "build", recording_build)
    try:
        config = EngineConfig(max_waiting_requests=64, cuda_graph=False, **engine)  # type: ignore[arg-type]
        with LLM.from_loaded(loaded, config) as llm:
            llm.generate(PROMPTS, params)
    finally:
        mp.undo()
    return seen


EAGER_CASES = {
    "llada, no cache": ("llada", DecodingParams(gen_length=16, block_length=8, steps=8), {}),
    "llada prefix cache": ("llada", DecodingParams(gen_length=16, block_length=8, steps=8),
                           {"kv_cache": "prefix"}),
    "dream (shifted logits)": ("dream", DecodingParams(gen_length=16, block_length=8, steps=8),
                               {}),
    "idlm rounds": ("idlm", DecodingParams(gen_length=16), {"isd_stride": 4}),
    "sdar blocks": ("sdar", DecodingParams(gen_length=16), {}),
    "fastdllm sub-blocks": ("fastdllm", DecodingParams(gen_length=16), {}),
    "tri-mode linear_spec (draft LoRA)": ("nemotron", DecodingParams(gen_length=16,
                                          decoding_mode="linear_spec"), {}),
    # MoE layers run their experts as grouped GEMMs (bf16, as on a GPU): nothing read back.
    "llada2 (MoE, sigmoid routing)": ("llada2", DecodingParams(gen_length=16), {}),
    "lladamoe (MoE, softmax routing)": ("lladamoe", DecodingParams(gen_length=16,
                                        block_length=8, steps=8), {}),
}  # fmt: skip


@pytest.fixture(scope="module")
def more_models(
    models: dict[str, LoadedModel], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, LoadedModel]:
    root = Path(tmp_path_factory.mktemp("capture-safety-eager"))
    out = dict(models)
    for family in ("dream", "fastdllm", "llada2", "lladamoe"):
        out[family] = load_model(str(write_tiny(family, root / family)), dtype="float32")
    return out


@pytest.mark.parametrize("case", list(EAGER_CASES))
def test_eager_forwards_neither_read_back_nor_copy_host_tensors(
    more_models: dict[str, LoadedModel], case: str
) -> None:
    family, params, engine = EAGER_CASES[case]
    loaded = more_models[family]
    steps = record_eager_steps(loaded, params, limit=24, **engine)
    assert steps, "no forward was recorded: the test would be vacuous"
    # bf16, the GPU's serving dtype: the grouped expert GEMMs are defined for it (the meta
    # device checks what CUDA checks).
    model = copy.deepcopy(loaded.model).to(META, torch.bfloat16)
    spans = [r.kv for rows in steps for r in rows if r.kv is not None]
    slots = (1 + max((page for kv in spans for page in kv.pages), default=0)) * PAGE_SIZE
    runner = ModelRunner(model, META, kv_slots=slots if spans else 0)
    kinds = set()
    with torch.no_grad():
        for rows in steps:
            flat, _width = runner.build(rows)  # the step's one host→device copy
            # The rope table is built on the host once and grows by doubling, both outside
            # any step (the graph runner builds it up front): not a per-step copy.
            model.rope(torch.zeros(1, dtype=torch.long, device=META), flat.max_position)
            with DeviceOnly(META) as guard:
                logits = runner.forward(flat)
            assert logits.device == META and guard.ops > 0
            kinds.add((rows[0].attention, rows[0].start > 0, rows[0].kv is not None))
    if engine.get("kv_cache") == "prefix" or family in ("idlm", "sdar", "fastdllm", "llada2"):
        assert any(cached for _, cached, _ in kinds), "no cached step was checked"
