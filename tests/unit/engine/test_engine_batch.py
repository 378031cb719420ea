"""Batched forwards: padding is invisible, so each row gets what it would get alone."""

from __future__ import annotations

import pytest
import torch

from dllm_serve.decoding.forward_spec import AttentionKind, RowSpec
from dllm_serve.engine.batch import build_batch, run_batch
from dllm_serve.models.loader import LoadedModel, load_model


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model("tiny-llada", device="cpu", dtype="float32")


def spec(length: int, seed: int, kind: AttentionKind, n_logits: int = 3) -> RowSpec:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 700, (length,), generator=g)
    index = torch.sort(torch.randperm(length, generator=g)[:n_logits]).values
    return RowSpec(ids, torch.arange(length), index, kind)


def alone(loaded: LoadedModel, s: RowSpec) -> torch.Tensor:
    return run_batch(loaded.model, build_batch([s], pad_id=loaded.mask_id))[0]


@pytest.mark.parametrize(
    "kinds",
    [
        [AttentionKind.BIDIRECTIONAL] * 3,
        [AttentionKind.CAUSAL] * 3,
        [AttentionKind.BIDIRECTIONAL, AttentionKind.CAUSAL, AttentionKind.BIDIRECTIONAL],
    ],
)
def test_rows_of_different_lengths_match_alone(loaded: LoadedModel, kinds: list) -> None:
    specs = [spec(n, i, k) for i, (n, k) in enumerate(zip([20, 7, 13], kinds, strict=True))]
    with torch.inference_mode():
        batched = run_batch(loaded.model, build_batch(specs, pad_id=loaded.mask_id))
        for s, got in zip(specs, batched, strict=True):
            torch.testing.assert_close(got, alone(loaded, s), rtol=0, atol=1e-5)


def test_causal_mask_is_causal_and_bidirectional_is_not(loaded: LoadedModel) -> None:
    base = spec(10, 0, AttentionKind.BIDIRECTIONAL, n_logits=10)
    changed_ids = base.input_ids.clone()
    changed_ids[-1] = (changed_ids[-1] + 1) % 700
    for kind, first_changes in ((AttentionKind.BIDIRECTIONAL, True), (AttentionKind.CAUSAL, False)):
        a = RowSpec(base.input_ids, base.positions, base.logits_index, kind)
        b = RowSpec(changed_ids, base.positions, base.logits_index, kind)
        with torch.inference_mode():
            la, lb = alone(loaded, a), alone(loaded, b)
        assert (not torch.allclose(la[0], lb[0])) is first_changes


def test_batch_shapes_and_mask_elision(loaded: LoadedModel) -> None:
    same = [spec(8, i, AttentionKind.BIDIRECTIONAL) for i in range(3)]
    batch = build_batch(same, pad_id=loaded.mask_id)
    assert batch.attn_mask is None  # equal lengths, bidirectional: nothing to hide
    assert (batch.num_rows, batch.num_tokens, batch.splits) == (3, 24, [3, 3, 3])
    mixed = build_batch(
        [spec(8, 0, AttentionKind.BIDIRECTIONAL), spec(5, 1, AttentionKind.CAUSAL)],
        pad_id=loaded.mask_id,
    )
    assert mixed.attn_mask is not None
    assert mixed.input_ids[1, 5:].tolist() == [loaded.mask_id] * 3
    assert not mixed.attn_mask[1, 0, 2, 3]  # causal row: no look ahead
    assert not mixed.attn_mask[1, 0, 0, 6]  # padded key hidden
    assert mixed.attn_mask[0, 0, 0, 7]  # bidirectional row sees ahead
