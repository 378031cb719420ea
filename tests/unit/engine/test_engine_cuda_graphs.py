"""The static forwards a CUDA graph captures, run uncaptured on CPU (FlexAttention, the code a
GPU runs): which forwards take them, that one graph serves a mix of rows of every kind, that
padding tokens never touch a request's K/V, and that every decoding mode gives exactly the
tokens of the eager runner through them. The same cases with real captured graphs on CUDA
against ``--no-cuda-graph`` are GPU-marked (``python -m pytest tests -m gpu``; fp32, TF32 off).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dllm_serve.api.metrics import Metrics
from dllm_serve.config import EngineConfig
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.decoding.protocol import AttentionKind, RowSpec
from dllm_serve.engine import engine as engine_module
from dllm_serve.engine.graphs import GraphKey, GraphRunner, graph_keys, logits_bucket
from dllm_serve.engine.model_runner import ModelRunner
from dllm_serve.llm import LLM
from dllm_serve.models.kv_pool import PAGE_SIZE, KVPages, KVPool
from dllm_serve.models.loader import LoadedModel, load_model
from dllm_serve.models.lora import attach_draft_lora
from dllm_serve_train.tiny_checkpoints import write_tiny

CPU = torch.device("cpu")
PROMPTS = [
    [{"role": "user", "content": text}]
    for text in ("What is 12 + 30?", "Hi", "Reverse the word cat, please.", "a b c d e f g")
]


pytestmark = pytest.mark.usefixtures("one_thread")


def cached_row(
    start: int, q: int = 8, *, kv_start: int = 0, logits: int = 2, **kw: object
) -> RowSpec:
    """A row whose pages are held already: contiguous from slot ``kv_start`` (a page
    boundary), enough for its prefix and its ``q`` tokens."""
    first, count = kv_start // PAGE_SIZE, -(-(start + q) // PAGE_SIZE)
    pages = list(range(first, first + count))
    span = KVPages(kv_start + 1, count, pages=pages, length=start)
    tokens = [3 + (start + i) % 7 for i in range(q)]
    return RowSpec(tokens=tokens, start=start, logits_at=list(range(logits)), kv=span, **kw)  # type: ignore[arg-type]


def mixed_rows() -> list[RowSpec]:
    """One forward of every kind of row a decoding mode sends, at different prefixes."""
    return [
        cached_row(10, kv_start=0),  # a cached block step (bidirectional over prefix + block)
        cached_row(33, q=7, kv_start=64, logits=7, attention=AttentionKind.CAUSAL),  # ISD 2N-1
        cached_row(40, q=4, kv_start=128, logits=4, attention=AttentionKind.CAUSAL),  # ISD N
        cached_row(16, q=8, kv_start=192, logits=4, attention=AttentionKind.BLOCK_CAUSAL,
                   block=4),  # a finished block's K/V write fused with the next block's step
        cached_row(20, q=8, kv_start=256, logits=8, draft=True),  # LinearSpec draft
        cached_row(5, q=3, kv_start=320, logits=3, attention=AttentionKind.CAUSAL),  # short prefix
    ]  # fmt: skip


def graph_runner(loaded: LoadedModel, slots: int = 512, max_tokens: int = 512) -> GraphRunner:
    cfg = loaded.model.config
    pool = KVPool(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, slots, scratch_slots=PAGE_SIZE)
    return GraphRunner(loaded.model, pool, CPU, max_tokens=max_tokens, capture=False)


def test_any_mix_of_cached_rows_that_fits_takes_a_graph_keyed_by_its_token_and_logit_counts() -> (
    None
):
    graphs = graph_runner(load_model("tiny-llada", device="cpu", dtype="float32"))
    rows = mixed_rows()
    tokens, logits = sum(len(r.tokens) for r in rows), sum(len(r.logits_at) for r in rows)
    assert (tokens, logits) == (38, 28)
    assert graphs.key_for(rows) == GraphKey(tokens=64, logits=32)
    assert graphs.key_for(rows[:1]) == GraphKey(16, 16)
    assert logits_bucket(1) == 16 and logits_bucket(17) == 32 and logits_bucket(64) == 64
    # Start-up captures a graph per token bucket and logits bucket up to it.
    assert graph_keys(64) == [GraphKey(16, 16), GraphKey(32, 16), GraphKey(32, 32),
                              GraphKey(64, 16), GraphKey(64, 32), GraphKey(64, 64)]  # fmt: skip
    context = graphs.max_context
    eager = {
        "no KV cache (a whole-canvas forward)": [RowSpec(tokens=[3] * 8, start=0, logits_at=[0])],
        "more tokens than the largest graph": [cached_row(40, q=300)] * 2,
        "past the model's context": [cached_row(context - 4)],
    }
    for why, case in eager.items():
        assert graphs.key_for(case) is None, why


def test_padding_tokens_write_only_the_scratch_page() -> None:
    loaded = load_model("tiny-llada", device="cpu", dtype="float32")
    runner = ModelRunner(loaded.model, CPU, kv_slots=512, cuda_graph=True, capture=False,
                         attention="flex")  # fmt: skip
    pool, graphs = runner.pool, runner.graphs
    assert pool is not None and graphs is not None
    generator = torch.Generator().manual_seed(0)
    pool.k[:, : pool.slots].copy_(torch.randn(pool.k[:, : pool.slots].shape, generator=generator))
    pool.v[:, : pool.slots].copy_(torch.randn(pool.v[:, : pool.slots].shape, generator=generator))
    before_k, before_v = pool.k.clone(), pool.v.clone()
    rows = [cached_row(10, kv_start=0), cached_row(20, kv_start=64), cached_row(5, kv_start=128)]
    with torch.inference_mode():
        logits = runner.run(rows)
    assert graphs.replays == 1 and list(graphs.graphs) == [GraphKey(32, 16)]
    assert logits.shape == (3, 2, loaded.model.config.vocab_size)
    assert logits.flat is not None and logits.flat.shape[0] == 6  # no padded logits handed on
    written = {s for r in rows for s in r.kv.slots(r.start, r.start + 8)}
    scratch = set(range(pool.scratch_start, pool.scratch_start + pool.scratch_slots))
    same_k = (pool.k == before_k).flatten(2).all(-1).all(0)
    same_v = (pool.v == before_v).flatten(2).all(-1).all(0)
    changed = set((~(same_k & same_v)).nonzero().flatten().tolist())
    assert written <= changed  # the rows' own tokens were written
    assert changed - written <= scratch  # and beside them only the padding's scratch page
    assert torch.count_nonzero(pool.k[:, pool.zero_slot]) == 0  # the zero slot stays zero


def fill_pool(runner: ModelRunner, seed: int) -> None:
    assert runner.pool is not None
    generator = torch.Generator().manual_seed(seed)
    for buffer in (runner.pool.k, runner.pool.v):
        part = buffer[:, : runner.pool.slots]
        part.copy_(torch.randn(part.shape, generator=generator))


def test_one_graph_serves_a_mix_of_every_kind_of_row_with_the_eager_logits(
    tmp_path: Path,
) -> None:
    """Cached block steps, I-DLM rounds of N and 2N − 1, a block-causal write, a draft row
    (draft LoRA on) and a short prefill, at different prefixes, in one static forward: each
    row's logits equal the eager runner's; the next step's different mix reuses the graph."""
    path = write_tiny("nemotron", tmp_path / "nemotron", block_size=8, seed=1,
                      draft_lora_out=tmp_path / "lora")  # fmt: skip
    loaded = load_model(str(path), device="cpu", dtype="float32")
    assert attach_draft_lora(loaded.model, tmp_path / "lora") == 2
    eager = ModelRunner(loaded.model, CPU, kv_slots=512, attention="flex")
    static = ModelRunner(loaded.model, CPU, kv_slots=512, attention="flex", cuda_graph=True,
                         capture=False)  # fmt: skip
    assert static.graphs is not None
    rows = mixed_rows()
    for runner in (eager, static):
        fill_pool(runner, seed=1)
    with torch.inference_mode():
        want, got = eager.run(rows), static.run(rows)
        assert static.graphs.replays == 1 and list(static.graphs.graphs) == [GraphKey(64, 32)]
        torch.testing.assert_close(got.as_padded(), want.as_padded(), rtol=1e-5, atol=1e-5)
        # Another mix in the same buckets (34 tokens, 24 logits): the same graph, fresh
        # inputs, still exact.
        again = [rows[5], rows[3], rows[1], rows[0], rows[4]]
        want, got = eager.run(again), static.run(again)
    assert static.graphs.replays == 2 and len(static.graphs.graphs) == 1
    torch.testing.assert_close(got.as_padded(), want.as_padded(), rtol=1e-5, atol=1e-5)


class StaticRunner(ModelRunner):
    """The engine's runner with the static forwards on, uncaptured (as on CPU they must be)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **{**kwargs, "cuda_graph": True, "capture": False})  # type: ignore[arg-type]


def generate(
    loaded: LoadedModel, params: DecodingParams, static: bool, **engine: object
) -> tuple[list[tuple[str, int]], int]:
    """(text, nfe) of every prompt, all at once, through FlexAttention; and how many forwards
    took a static forward (captured graphs on CUDA, where the engine turns them on itself)."""
    mp = pytest.MonkeyPatch()
    if static and loaded.device.type == "cpu":
        mp.setattr(engine_module, "ModelRunner", StaticRunner)
    try:
        config = EngineConfig(max_waiting_requests=64, cuda_graph=static,
                              attention_backend="flex", **engine)  # type: ignore[arg-type]  # fmt: skip
        with LLM.from_loaded(loaded, config) as llm:
            metrics = llm.engine.observer = Metrics(lambda: 0, lambda: 0)
            out = [(c.text, c.nfe) for c in llm.generate(PROMPTS, params)]
            graphs = llm.engine.runner.graphs
            assert (graphs is not None) == static
            # Prometheus counts the replays among the forwards.
            sample = metrics.registry.get_sample_value
            replayed = sample("dllm:forward_graph_replays_total")
            assert replayed == (graphs.replays if graphs is not None else 0)
            assert sample("dllm:forward_duration_seconds_count") >= replayed
            assert llm.engine.kv_cache_bytes == 0  # every page went back to the pool
            if graphs is not None and loaded.device.type == "cuda":
                assert all(s.graph is not None for s in graphs.graphs.values())  # captured
            return out, graphs.replays if graphs is not None else 0
    finally:
        mp.undo()


def tiny_models(root: Path, device: str) -> dict[str, LoadedModel]:
    models = {"llada": load_model("tiny-llada", device=device, dtype="float32")}
    for family in ("idlm", "sdar", "llada2"):
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
    "llada2 blocks (MoE, grouped experts)": ("llada2", DecodingParams(gen_length=24), {}),
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


def test_the_graph_token_limit_flag() -> None:
    from dllm_serve.cli import parse_config

    assert parse_config([]).engine.cuda_graph_max_tokens == 1024
    assert parse_config(["--cuda-graph-max-tokens", "256"]).engine.cuda_graph_max_tokens == 256
    for bad in (8, 9000):
        with pytest.raises(ValueError, match="cuda_graph_max_tokens must be between 16 and 8192"):
            EngineConfig(cuda_graph_max_tokens=bad)
    with pytest.raises(SystemExit):
        parse_config(["--cuda-graph-max-tokens", "8"])
