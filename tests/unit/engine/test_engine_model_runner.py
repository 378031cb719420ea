"""ModelRunner: flat packing without padding, attention groups, and each row's logits exactly
what the row gets alone (and what the padded reference forward gives), with or without a
cached KV prefix; logits rows padded per row."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dllm_serve.config import EngineConfig
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.decoding.protocol import AttentionKind, RowSpec
from dllm_serve.engine.model_runner import ModelRunner
from dllm_serve.llm import LLM
from dllm_serve.models.kv_pool import KVPages
from dllm_serve.models.loader import LoadedModel, load_model

BI, CAUSAL = AttentionKind.BIDIRECTIONAL, AttentionKind.CAUSAL
TOL = 1e-5
CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model("tiny-llada", device="cpu", dtype="float32")


@pytest.fixture
def runner(loaded: LoadedModel) -> ModelRunner:
    return ModelRunner(loaded.model, CPU, kv_slots=512)


def tokens(length: int, seed: int) -> list[int]:
    return torch.randint(0, 700, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def row(length: int, seed: int, kind: AttentionKind, n_logits: int = 3) -> RowSpec:
    g = torch.Generator().manual_seed(seed)
    at = torch.sort(torch.randperm(length, generator=g)[:n_logits]).values.tolist()
    return RowSpec(tokens(length, seed), 0, at, kind)


def alone(runner: ModelRunner, r: RowSpec) -> torch.Tensor:
    return runner.run([r])[0, : len(r.logits_at)]


def reference(loaded: LoadedModel, r: RowSpec) -> torch.Tensor:
    """The padded reference forward of one row without a prefix (explicit mask)."""
    n = len(r.tokens)
    mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None] if r.causal else None
    with torch.inference_mode():
        hidden = loaded.model(r.input_ids[None], r.positions[None], mask)
        return loaded.model.lm_head(hidden[0, r.logits_index])


def test_flat_packing_has_no_padding_and_asks_the_head_for_real_positions_only(
    runner: ModelRunner,
) -> None:
    rows = [row(8, 0, BI, 2), row(5, 1, CAUSAL, 1), row(6, 2, BI, 3)]
    batch, width = runner.build(rows)
    assert width == 3 and batch.num_tokens == 8 + 5 + 6
    assert batch.input_ids.tolist() == rows[0].tokens + rows[1].tokens + rows[2].tokens
    assert batch.positions.tolist() == [*range(8), *range(5), *range(6)]
    assert batch.slot_mapping is None  # no span: nothing written anywhere
    # Each row's requested positions, back to back: 2 + 1 + 3, no row padded to 3.
    a, b, c = rows[0].logits_at, rows[1].logits_at, rows[2].logits_at
    assert batch.logits_index.tolist() == [*a, b[0] + 8, *(i + 13 for i in c)]
    assert (batch.logit_counts, batch.logit_offsets) == ([2, 1, 3], [0, 2, 3])
    # The per-row layout: past a row's own positions, its first again.
    assert batch.logit_layout.tolist() == [[0, 1, 0], [2, 2, 2], [3, 4, 5]]
    logits = runner.run(rows)
    assert logits.flat.shape == (6, runner.model.config.vocab_size)
    assert logits.shape == (3, 3, runner.model.config.vocab_size)
    torch.testing.assert_close(logits[0, 2], logits[0, 0], rtol=0, atol=0)
    torch.testing.assert_close(logits[1, 1:], logits[1, :1].expand(2, -1), rtol=0, atol=0)


def test_positions_start_where_the_row_says(runner: ModelRunner) -> None:
    batch, _ = runner.build([RowSpec([1, 2, 3], 0, [0]), RowSpec([4, 5], 0, [1])])
    assert batch.positions.tolist() == [0, 1, 2, 0, 1]
    pool = runner.pool
    assert pool is not None
    span = pool.reserve(10)
    assert span is not None
    span.length = 7
    batch, _ = runner.build([RowSpec([4, 5], 7, [1], CAUSAL, kv=span)])
    assert batch.positions.tolist() == [7, 8]
    assert batch.slot_mapping is not None
    assert batch.slot_mapping.tolist() == [span.slot(7), span.slot(8)]


def test_groups_merge_consecutive_rows_of_one_shape(runner: ModelRunner) -> None:
    rows = [row(6, 0, BI), row(6, 1, BI), row(6, 2, CAUSAL), row(4, 3, CAUSAL), row(6, 4, BI)]
    batch, _ = runner.build(rows)
    shapes = [(g.start, g.rows, g.q_len, g.is_causal) for g in batch.groups]
    assert shapes == [(0, 2, 6, False), (12, 1, 6, True), (18, 1, 4, True), (22, 1, 6, False)]
    assert all(g.kv_slots is None and g.mask is None for g in batch.groups)
    assert batch.groups[-1].end == batch.num_tokens


@pytest.mark.parametrize(
    "kinds",
    [[BI] * 4, [CAUSAL] * 4, [BI, CAUSAL, BI, CAUSAL]],
    ids=["bidirectional", "causal", "mixed"],
)
def test_rows_of_different_lengths_match_alone(
    loaded: LoadedModel, runner: ModelRunner, kinds: list[AttentionKind]
) -> None:
    # Two rows of one length (one shared group) and two others.
    specs = [row(n, i, k) for i, (n, k) in enumerate(zip([20, 7, 7, 13], kinds, strict=True))]
    batched = runner.run(specs)
    for r, s in enumerate(specs):
        got = batched[r, : len(s.logits_at)]
        torch.testing.assert_close(got, alone(runner, s), rtol=0, atol=TOL)
        torch.testing.assert_close(got, reference(loaded, s), rtol=0, atol=TOL)


def test_causal_is_causal_and_bidirectional_is_not(runner: ModelRunner) -> None:
    base = row(10, 0, BI, n_logits=10)
    changed = list(base.tokens)
    changed[-1] = (changed[-1] + 1) % 700
    for kind, first_changes in ((BI, True), (CAUSAL, False)):
        a = RowSpec(base.tokens, 0, base.logits_at, kind)
        b = RowSpec(changed, 0, base.logits_at, kind)
        la, lb = alone(runner, a), alone(runner, b)
        assert (not torch.allclose(la[0], lb[0])) is first_changes
        assert not torch.allclose(la[-1], lb[-1])  # the changed token's own output


def prefill(runner: ModelRunner, ids: list[int], kind: AttentionKind, capacity: int) -> KVPages:
    """A span holding the K/V of ``ids`` computed alone (``length = len(ids)``)."""
    assert runner.pool is not None
    span = runner.pool.reserve(capacity)
    assert span is not None
    runner.run([RowSpec(ids, 0, [len(ids) - 1], kind, kv=span)])
    span.length = len(ids)
    return span


def prefix_reference(
    loaded: LoadedModel, ids: list[int], p: int, kind: AttentionKind, at: list[int]
) -> torch.Tensor:
    """``ids[p:]`` against the K/V of ``ids[:p]`` computed alone, as one padded forward:
    causal, the plain causal forward; bidirectional, the prefix sees only itself and the
    rest sees everything."""
    n = len(ids)
    if kind is CAUSAL:
        mask = torch.ones(n, n, dtype=torch.bool).tril()
    else:
        mask = torch.ones(n, n, dtype=torch.bool)
        mask[:p, p:] = False
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor([ids]), torch.arange(n)[None], mask[None, None])
        return loaded.model.lm_head(hidden[0, [p + i for i in at]])


@pytest.mark.parametrize("kind", [CAUSAL, BI], ids=["causal", "bidirectional"])
def test_rows_with_kv_prefixes_match_alone_and_the_reference(
    loaded: LoadedModel, runner: ModelRunner, kind: AttentionKind
) -> None:
    """Prefixes of different lengths, including equal and ragged ones in one group (equal row
    lengths) and a row with a span but no prefix yet, in one forward."""
    prefixes, news = [9, 4, 4, 13, 0, 6], [5, 5, 5, 5, 5, 3]
    ids = [tokens(p + n, 100 + r) for r, (p, n) in enumerate(zip(prefixes, news, strict=True))]
    assert runner.pool is not None
    spans = [
        prefill(runner, t[:p], kind, 32) if p else runner.pool.reserve(32)
        for t, p in zip(ids, prefixes, strict=True)
    ]
    rows = [
        RowSpec(t[p:], p, list(range(n)), kind, kv=s)
        for t, p, n, s in zip(ids, prefixes, news, spans, strict=True)
    ]
    batch, _ = runner.build(rows)
    cached = [g for g in batch.groups if g.kv_slots is not None]
    assert [g.rows for g in cached] == [4, 1]  # rows 0-3 share one; row 4 reads no prefix
    assert cached[0].mask is not None and cached[0].mask.dim() == 4  # ragged prefixes
    batched = runner.run(rows)
    for r, (t, p, n) in enumerate(zip(ids, prefixes, news, strict=True)):
        got = batched[r, :n]
        torch.testing.assert_close(got, prefix_reference(loaded, t, p, kind, list(range(n))),
                                   rtol=0, atol=TOL)  # fmt: skip
    # The same rows one at a time (their prefixes untouched: only the current tokens are
    # (re)written, to the same slots, with the same values).
    for r, s in enumerate(rows):
        torch.testing.assert_close(batched[r, : news[r]], alone(runner, s), rtol=0, atol=TOL)


@pytest.mark.parametrize("kind", [CAUSAL, BI], ids=["causal", "bidirectional"])
def test_equal_prefixes_share_a_group_without_a_ragged_mask(
    loaded: LoadedModel, runner: ModelRunner, kind: AttentionKind
) -> None:
    ids = [tokens(11, 200 + r) for r in range(3)]
    rows = [RowSpec(t[7:], 7, [0, 2, 3], kind, kv=prefill(runner, t[:7], kind, 16)) for t in ids]
    batch, _ = runner.build(rows)
    (group,) = batch.groups
    assert group.rows == 3 and group.kv_slots is not None
    assert group.kv_slots.shape == (3, 11)
    if kind is BI:
        assert group.mask is None
    else:
        assert group.mask is not None and tuple(group.mask.shape)[-2:] == (4, 11)
    batched = runner.run(rows)
    for r, t in enumerate(ids):
        want = prefix_reference(loaded, t, 7, kind, [0, 2, 3])
        torch.testing.assert_close(batched[r], want, rtol=0, atol=TOL)


def test_forward_writes_kv_to_the_row_slots_only(runner: ModelRunner) -> None:
    pool = runner.pool
    assert pool is not None
    a, b = pool.reserve(8), pool.reserve(8)
    assert a is not None and b is not None
    before = pool.k.clone()
    runner.run([RowSpec(tokens(5, 0), 0, [4], CAUSAL, kv=a)])
    written = (pool.k != before).any(dim=(0, 2, 3)).nonzero().flatten().tolist()
    assert written == a.slots(0, 5)
    assert a.length == 0 and b.length == 0  # what to keep is the algorithm's call


def test_invalid_rows_are_refused(runner: ModelRunner) -> None:
    pool = runner.pool
    assert pool is not None
    span = pool.reserve(4)
    assert span is not None
    with pytest.raises(ValueError, match="KV cache"):
        runner.build([RowSpec([1, 2], 0, [0]), RowSpec([1, 2], 0, [0], kv=span)])
    with pytest.raises(ValueError, match="overflows"):  # past its reservation: one page
        runner.build([RowSpec(list(range(17)), 0, [0], kv=span)])
    with pytest.raises(ValueError, match="at least one"):
        runner.build([RowSpec([1, 2], 0, [])])
    with pytest.raises(ValueError, match="at least one"):
        runner.build([RowSpec([], 0, [0])])


def test_runner_without_a_pool(loaded: LoadedModel) -> None:
    runner = ModelRunner(loaded.model, CPU)
    assert runner.pool is None
    r = row(9, 5, BI)
    torch.testing.assert_close(alone(runner, r), reference(loaded, r), rtol=0, atol=TOL)
    assert runner.forward_seconds() > 0


# ---- isolation of ragged rows --------------------------------------------------------------------


@pytest.mark.parametrize("kind", [CAUSAL, BI], ids=["causal", "bidirectional"])
def test_masked_padding_keys_never_leak_into_a_row(
    runner: ModelRunner, kind: AttentionKind
) -> None:
    """Rows of one length with ragged prefixes: the shorter-prefix row's keys are padded with
    whatever the pool holds past them (its own unwritten slots, other requests' spans), masked.
    Masking does not neutralise a non-finite value (0 · NaN = NaN in ``softmax @ V``), so a
    NaN/inf K/V left in *another* request's slots (an fp16 overflow, a previous owner of the
    slots) must not reach this row (the pre-v2 KVBatch padded with zeros; v2 points masked
    keys at the pool's zero slot)."""
    pool = runner.pool
    assert pool is not None
    a, b, other = pool.reserve(10), pool.reserve(20), pool.reserve(10)
    assert a is not None and b is not None and other is not None
    for span, p in ((a, 2), (b, 12)):
        runner.run([RowSpec(tokens(p, p), 0, [0], kind, kv=span)])
        span.length = p
    rows = [RowSpec([7, 8, 9], 2, [0, 1, 2], kind, kv=a), RowSpec([7, 8, 9], 12, [0], kind, kv=b)]
    clean = runner.run(rows)[0].clone()
    # Poison slots that are not row a's: the rest of its own page past its tokens, and
    # another request's page.
    pool.grow(other, 10)
    for buf in (pool.k, pool.v):
        buf[:, a.slots(5, 16)] = float("nan")
        buf[:, other.slots(0, 16)] = float("nan")
    got = runner.run(rows)[0]
    assert not pool.k[:, pool.zero_slot].any() and not pool.v[:, pool.zero_slot].any()
    assert not got.isnan().any()
    torch.testing.assert_close(got, clean, rtol=0, atol=TOL)


@pytest.mark.parametrize("kv_cache", ["none", "prefix"])
def test_the_lm_head_runs_on_the_requested_positions_only_in_mixed_traffic(
    kv_cache: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """16 requests of different prompts and canvases through the engine: every forward's LM
    head sees exactly the sum of its rows' requested positions, never rows × the widest."""
    loaded = load_model("tiny-llada", device="cpu", dtype="float32")
    head_rows: list[int] = []
    asked: list[tuple[int, int]] = []  # (sum of requested positions, rows × widest)
    real_head = loaded.model.lm_head
    real_build = ModelRunner.build

    def head(hidden: torch.Tensor) -> torch.Tensor:
        head_rows.append(hidden.shape[0])
        return real_head(hidden)

    def build(self: ModelRunner, rows: list[RowSpec]) -> Any:
        counts = [len(r.logits_at) for r in rows]
        asked.append((sum(counts), len(rows) * max(counts)))
        return real_build(self, rows)

    monkeypatch.setattr(loaded.model, "lm_head", head)
    monkeypatch.setattr(ModelRunner, "build", build)
    prompts = [[5 + i, 6, 7, *range(8, 8 + i)] for i in range(16)]
    # Canvases of 8 to 24 in blocks of 8, one or two commits a step: rows at different
    # steps of their blocks ask for different numbers of positions.
    params = [
        DecodingParams(gen_length=8 * (1 + i % 3), block_length=8, steps=(8 >> i % 2) * (1 + i % 3))
        for i in range(16)
    ]
    with LLM.from_loaded(loaded, EngineConfig(kv_cache=kv_cache)) as llm:
        llm.generate_ids(prompts, params)
    assert head_rows == [total for total, _ in asked]
    assert any(total < padded for total, padded in asked)  # the traffic was mixed
