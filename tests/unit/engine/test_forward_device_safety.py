"""The forwards keep to the device: every graphed one is capture-safe, checked without a GPU.

A captured region may launch device work only: reading a device value on the host (``.item()``,
``nonzero``, boolean indexing, ``tolist``) fails the capture, and so does copying host memory
to the device inside it (``torch.tensor(list, device=...)``, a CPU index tensor) — and either
would waste a rare GPU window. On CPU the static forwards run uncaptured, where neither shows.
So here each decoding mode's graphed steps are first recorded on CPU through the engine (the
rows of every graph shape it would capture), then replayed on the **meta device**: tensors
there have shapes and no data, so any op that needs a value raises, and a dispatch mode fails
any op handed a tensor of another device (a host tensor that a GPU forward would copy over).
FlexAttention refuses the meta device; its stand-in reads what the compiled kernel reads (the
block mask's tensors, the mask function over every query and key) by device ops.

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
from dllm_serve.engine.graphs import GraphKey, GraphRunner
from dllm_serve.engine.model_runner import BatchPacker, ModelRunner
from dllm_serve.llm import LLM
from dllm_serve.models import layers
from dllm_serve.models.kv_pool import PAGE_SIZE, KVPool
from dllm_serve.models.loader import LoadedModel, load_model
from dllm_serve_train.tiny_checkpoints import write_tiny

META = torch.device("meta")
pytestmark = pytest.mark.usefixtures("one_thread")


def record_graphed_steps(
    loaded: LoadedModel, params: DecodingParams, **engine: object
) -> dict[GraphKey, list[RowSpec]]:
    """The rows of the first forward of each graph shape the engine takes."""
    seen: dict[GraphKey, list[RowSpec]] = {}
    fill = BatchPacker.fill

    def recording_fill(self: BatchPacker, static: Any, rows: list[RowSpec]) -> Any:
        seen.setdefault(static.key, copy.deepcopy(rows))
        return fill(self, static, rows)

    mp = pytest.MonkeyPatch()
    mp.setattr(engine_module, "ModelRunner", StaticRunner)
    mp.setattr(BatchPacker, "fill", recording_fill)
    try:
        config = EngineConfig(max_waiting_requests=64, cuda_graph=True,
                              attention_backend="flex", **engine)  # type: ignore[arg-type]  # fmt: skip
        with LLM.from_loaded(loaded, config) as llm:
            llm.generate(PROMPTS, params)
    finally:
        mp.undo()
    assert seen, "no step took a static forward: the test would be vacuous"
    return seen


def meta_flex_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Any) -> torch.Tensor:
    """FlexAttention's stand-in on the meta device (flex refuses it): the compiled kernel is
    device code that reads its block mask's tensors and what the mask function reads; so those
    are read here, by device ops — the block lists, and the mask function evaluated over every
    query and key (a host tensor captured by it fails the guard) — and the output has the
    kernel's shape. The kernel's own capture is what the GPU tests check."""
    mask = plan.block_mask
    queries = torch.arange(q.shape[0], device=q.device)
    keys = torch.arange(k.shape[0], device=q.device)
    zero = torch.zeros((), dtype=torch.long, device=q.device)
    visible = mask.mask_mod(zero, zero, queries[:, None], keys[None, :])
    touched = mask.kv_num_blocks.sum() + mask.kv_indices.sum() + visible.sum()
    return q + touched.to(q.dtype) * 0 + v[: q.shape[0], :1].sum() * 0


@pytest.fixture
def meta_flex(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layers, "flex_attend", meta_flex_attend)


def replay_on_meta(loaded: LoadedModel, steps: dict[GraphKey, list[RowSpec]]) -> int:
    """Each recorded step through a GraphRunner of a data-less copy of the model; ops run.
    In bf16, the GPU's serving dtype: the grouped expert GEMMs of MoE layers are defined for it
    (the meta kernel checks the dtype)."""
    model = copy.deepcopy(loaded.model).to(META, torch.bfloat16)
    cfg = model.config
    pages = [page for rows in steps.values() for r in rows for page in r.kv.pages]
    slots = (1 + max(pages)) * PAGE_SIZE
    pool = KVPool(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, slots, device=META,
                  dtype=torch.bfloat16, scratch_slots=PAGE_SIZE)  # fmt: skip
    graphs = GraphRunner(model, pool, META, capture=False)
    packer = BatchPacker(META, pool, "flex", row_pages=pool.pages_for(graphs.max_context))
    ops = 0
    with torch.inference_mode():
        for key, rows in steps.items():
            static = graphs.static_for(key)
            assert static is not None
            packer.fill(static, rows)  # the copies before a replay
            guard = DeviceOnly(META)
            with guard:
                logits = graphs.run(static)
            assert logits.device == META
            assert logits.shape == (key.logits, cfg.vocab_size)
            ops += guard.ops
    return ops


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoadedModel]:
    return tiny_models(Path(tmp_path_factory.mktemp("capture-safety")), "cpu")


# Every decoding mode the CPU and GPU graph tests run (docs/architecture.md, "CUDA graphs").
CASES = GRAPH_CASES


@pytest.mark.parametrize("case", list(CASES))
def test_graphed_steps_are_capture_safe(
    models: dict[str, LoadedModel], case: str, meta_flex: None
) -> None:
    family, params, engine = CASES[case]
    steps = record_graphed_steps(models[family], params, **engine)
    assert replay_on_meta(models[family], steps) > 0
    if params.decoding_mode == "linear_spec":  # draft rows were among the graphed ones
        assert any(row.draft for rows in steps.values() for row in rows)


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
