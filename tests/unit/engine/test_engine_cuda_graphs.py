"""The static forwards a CUDA graph captures, run uncaptured on CPU: which steps take them,
that padding rows never touch a request's K/V, and that every decoding mode gives exactly the
tokens of the eager runner through them. The same cases with real captured graphs on CUDA
against ``--no-cuda-graph`` are GPU-marked (``python -m pytest tests -m gpu``; fp32, TF32 off).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dllm_serve.config import EngineConfig
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.decoding.protocol import AttentionKind, RowSpec
from dllm_serve.engine import engine as engine_module
from dllm_serve.engine.graphs import CONTEXT_QUANTUM, MAX_Q, GraphKey, graph_key
from dllm_serve.engine.model_runner import ModelRunner
from dllm_serve.llm import LLM
from dllm_serve.models.kv_pool import PAGE_SIZE, KVPages
from dllm_serve.models.loader import LoadedModel, load_model
from dllm_serve.models.lora import attach_draft_lora
from dllm_serve_train.tiny_checkpoints import write_tiny

CPU = torch.device("cpu")
PROMPTS = [
    [{"role": "user", "content": text}]
    for text in ("What is 12 + 30?", "Hi", "Reverse the word cat, please.", "a b c d e f g")
]


pytestmark = pytest.mark.usefixtures("one_thread")


def cached_row(start: int, q: int = 8, *, kv_start: int = 0, **kw: object) -> RowSpec:
    """A row whose pages are held already: contiguous from slot ``kv_start`` (a page
    boundary), enough for its prefix and its ``q`` tokens."""
    first, count = kv_start // PAGE_SIZE, -(-(start + q) // PAGE_SIZE)
    pages = list(range(first, first + count))
    span = KVPages(kv_start + 1, count, pages=pages, length=start)
    return RowSpec(tokens=[3] * q, start=start, logits_at=[0, 1], kv=span, **kw)  # type: ignore[arg-type]


def test_only_cached_rows_of_one_shape_and_phase_take_a_graph() -> None:
    rows = [cached_row(40), cached_row(300, kv_start=600), cached_row(7, kv_start=1200)]
    key = graph_key(rows, max_rows=32, max_context=4096)
    assert key == GraphKey(rows=4, q_len=8, causal=False, context=2 * CONTEXT_QUANTUM, width=2,
                           draft=False)  # fmt: skip
    causal = [cached_row(40, attention=AttentionKind.CAUSAL)]
    assert graph_key(causal, 32, 4096) == GraphKey(1, 8, True, CONTEXT_QUANTUM, 2, False)
    uneligible = {
        "a refresh or prefill row (nothing cached)": [cached_row(40), cached_row(0)],
        "another query length": [cached_row(40), cached_row(40, q=4)],
        "another attention kind": [cached_row(40), cached_row(40, attention=AttentionKind.CAUSAL)],
        "draft and base rows together": [cached_row(40), cached_row(40, draft=True)],
        "block-causal (a block-diffusion write)": [
            cached_row(40, attention=AttentionKind.BLOCK_CAUSAL, block=4)
        ],
        "no KV span": [RowSpec(tokens=[3] * 8, start=0, logits_at=[0])],
        "more rows than the largest graph": [cached_row(40)] * 5,
        "longer than the largest context": [cached_row(5000)],
        "longer rows than the scratch holds": [cached_row(40, q=MAX_Q + 1)],
    }
    for why, case in uneligible.items():
        assert graph_key(case, max_rows=4, max_context=4096) is None, why


def test_padding_rows_write_only_scratch_slots() -> None:
    loaded = load_model("tiny-llada", device="cpu", dtype="float32")
    runner = ModelRunner(loaded.model, CPU, kv_slots=256, cuda_graph=True, capture=False)
    pool, graphs = runner.pool, runner.graphs
    assert pool is not None and graphs is not None
    generator = torch.Generator().manual_seed(0)
    pool.k[:, : pool.slots].copy_(torch.randn(pool.k[:, : pool.slots].shape, generator=generator))
    pool.v[:, : pool.slots].copy_(torch.randn(pool.v[:, : pool.slots].shape, generator=generator))
    before_k, before_v = pool.k.clone(), pool.v.clone()
    rows = [cached_row(10, kv_start=0), cached_row(20, kv_start=64), cached_row(5, kv_start=128)]
    with torch.inference_mode():
        logits = runner.run(rows)
    assert graphs.replays == 1 and list(graphs.graphs) == [graph_key(rows, 32, 4096)]
    assert logits.shape == (3, 2, loaded.model.config.vocab_size)
    written = {s for r in rows for s in r.kv.slots(r.start, r.start + 8)}
    scratch = set(range(pool.scratch_start, pool.scratch_start + pool.scratch_slots))
    same_k = (pool.k == before_k).flatten(2).all(-1).all(0)
    same_v = (pool.v == before_v).flatten(2).all(-1).all(0)
    changed = set((~(same_k & same_v)).nonzero().flatten().tolist())
    assert written <= changed  # the rows' own tokens were written
    assert changed - written <= scratch  # and beside them only the padding row's scratch
    assert torch.count_nonzero(pool.k[:, pool.zero_slot]) == 0  # the zero slot stays zero


def test_static_forward_gives_the_eager_logits() -> None:
    """Same rows through the padded static forward and the eager runner: same logits."""
    loaded = load_model("tiny-llada", device="cpu", dtype="float32")
    eager = ModelRunner(loaded.model, CPU, kv_slots=256)
    static = ModelRunner(loaded.model, CPU, kv_slots=256, cuda_graph=True, capture=False)
    generator = torch.Generator().manual_seed(1)
    for runner in (eager, static):
        assert runner.pool is not None
        runner.pool.k[:, :256].copy_(torch.randn((2, 256, 4, 16), generator=generator))
        generator.manual_seed(1)
    rows = [cached_row(10, kv_start=0), cached_row(33, kv_start=64)]
    with torch.inference_mode():
        want, got = eager.run(rows).as_padded(), static.run(rows).as_padded()
    assert static.graphs is not None and static.graphs.replays == 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class StaticRunner(ModelRunner):
    """The engine's runner with the static forwards on, uncaptured (as on CPU they must be)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **{**kwargs, "cuda_graph": True, "capture": False})  # type: ignore[arg-type]


def generate(
    loaded: LoadedModel, params: DecodingParams, static: bool, **engine: object
) -> tuple[list[tuple[str, int]], int]:
    """(text, nfe) of every prompt, all at once; and how many steps took a static forward
    (captured graphs on CUDA, where the engine turns them on itself)."""
    mp = pytest.MonkeyPatch()
    if static and loaded.device.type == "cpu":
        mp.setattr(engine_module, "ModelRunner", StaticRunner)
    try:
        config = EngineConfig(max_waiting_requests=64, cuda_graph=static, **engine)  # type: ignore[arg-type]
        with LLM.from_loaded(loaded, config) as llm:
            out = [(c.text, c.nfe) for c in llm.generate(PROMPTS, params)]
            graphs = llm.engine.runner.graphs
            assert (graphs is not None) == static
            assert llm.engine.kv_cache_bytes == 0  # every span went back to the pool
            if graphs is not None and loaded.device.type == "cuda":
                assert all(s.graph is not None for s in graphs.graphs.values())  # captured
            return out, graphs.replays if graphs is not None else 0
    finally:
        mp.undo()


def tiny_models(root: Path, device: str) -> dict[str, LoadedModel]:
    models = {"llada": load_model("tiny-llada", device=device, dtype="float32")}
    for family in ("idlm", "sdar"):
        path = write_tiny(family, root / family)
        models[family] = load_model(str(path), device=device, dtype="float32")
    path = write_tiny("nemotron", root / "nemotron", block_size=8, seed=1,
                      draft_lora_out=root / "lora")  # fmt: skip
    nemotron = load_model(str(path), device=device, dtype="float32")
    assert attach_draft_lora(nemotron.model, root / "lora") == 2
    models["nemotron"] = nemotron
    return models


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoadedModel]:
    return tiny_models(Path(tmp_path_factory.mktemp("graphs")), "cpu")


@pytest.fixture(scope="module")
def tiny_cuda(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoadedModel]:
    return tiny_models(Path(tmp_path_factory.mktemp("graphs-cuda")), "cuda")


CASES = {
    "llada prefix cache": ("llada", DecodingParams(gen_length=32, block_length=8, steps=16),
                           {"kv_cache": "prefix"}),
    "llada prefix cache, seeded": ("llada", DecodingParams(gen_length=16, block_length=8,
                                   steps=16, temperature=0.8, seed=3), {"kv_cache": "prefix"}),
    "idlm rounds": ("idlm", DecodingParams(gen_length=24), {"isd_stride": 4}),
    "sdar blocks": ("sdar", DecodingParams(gen_length=24), {}),
    "tri-mode linear_spec (draft LoRA)": ("nemotron", DecodingParams(gen_length=24,
                                          decoding_mode="linear_spec"), {}),
    "tri-mode ar": ("nemotron", DecodingParams(gen_length=24, decoding_mode="ar"), {}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_static_forwards_give_the_eager_tokens(tiny: dict[str, LoadedModel], case: str) -> None:
    family, params, engine = CASES[case]
    want, none = generate(tiny[family], params, static=False, **engine)
    got, replays = generate(tiny[family], params, static=True, **engine)
    assert none == 0 and replays > 0, "no step took a static forward: the test would be vacuous"
    assert got == want


@pytest.fixture
def no_tf32() -> Iterator[None]:
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", list(CASES))
def test_captured_graphs_give_the_eager_tokens_on_cuda(
    tiny_cuda: dict[str, LoadedModel], case: str, no_tf32: None
) -> None:
    family, params, engine = CASES[case]
    want, none = generate(tiny_cuda[family], params, static=False, **engine)
    got, replays = generate(tiny_cuda[family], params, static=True, **engine)
    assert none == 0 and replays > 0, "no graph was replayed: the test would be vacuous"
    assert got == want
