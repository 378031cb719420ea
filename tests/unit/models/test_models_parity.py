"""Dream vs transformers' Qwen2 (bidirectional) and I-DLM vs Qwen3 (causal), fp32 on CPU:
unpadded, padded, and reading a KV prefix from the KV pool through the serving path
(``ModelRunner`` → ``forward_flat``; vs the same attention without a cache)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_reference import float_mask, hf_reference, padded_mask, perturb_norms

from dllm_serve.decoding.protocol import AttentionKind, RowSpec
from dllm_serve.engine.model_runner import ModelRunner
from dllm_serve.models.families import DREAM, SDAR
from dllm_serve.models.loader import load_model
from dllm_serve_train.tiny_checkpoints import write_tiny_dream, write_tiny_idlm

TOL = 1e-4


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.fixture(scope="module")
def dream(tmp_path_factory: pytest.TempPathFactory):
    path = write_tiny_dream(tmp_path_factory.mktemp("dream") / "d", seed=5, n_kv_heads=2)
    perturb_norms(path)
    return load_model(str(path), dtype="float32").model, hf_reference(path)


@pytest.fixture(scope="module")
def idlm(tmp_path_factory: pytest.TempPathFactory):
    path = write_tiny_idlm(tmp_path_factory.mktemp("idlm") / "i", seed=6, head_dim=24)
    perturb_norms(path)
    return load_model(str(path), dtype="float32").model, hf_reference(path)


def random_ids(vocab: int, batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_dream_bidirectional(dream) -> None:
    ours, ref = dream
    ids = random_ids(ours.config.vocab_size, 2, 12, 0)
    pos = torch.arange(12).expand(2, 12)
    full = torch.ones(2, 1, 12, 12, dtype=torch.bool)
    mine = ours.lm_head(ours(ids, pos))
    want = ref(input_ids=ids, position_ids=pos, attention_mask=float_mask(full)).logits
    assert max_diff(mine, want) <= TOL
    # Teeth: Qwen2's own causal attention is clearly different.
    assert max_diff(mine, ref(input_ids=ids, position_ids=pos).logits) > 100 * TOL


def left_padded_positions(keep: torch.Tensor) -> torch.Tensor:
    """Rotary positions of left-padded rows: 0 at the first real token (``cumsum(keep) - 1``)."""
    return (keep.long().cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def test_dream_left_padded_positions_from_mask(dream) -> None:
    ours, ref = dream
    ids = random_ids(ours.config.vocab_size, 2, 12, 1)
    mask = padded_mask([12, 8], 12, causal=False, left=True)
    pos = left_padded_positions(mask[:, 0, -1])  # cumsum(mask) - 1, as Dream's own code
    assert pos[1, 4].item() == 0 and pos[1, -1].item() == 7
    mine = ours.lm_head(ours(ids, pos, mask))
    want = ref(input_ids=ids, position_ids=pos, attention_mask=float_mask(mask)).logits
    assert max_diff(mine[0], want[0]) <= TOL
    assert max_diff(mine[1, 4:], want[1, 4:]) <= TOL
    # The padded row equals its unpadded self.
    alone = ours.lm_head(ours(ids[1:, 4:], torch.arange(8)[None]))
    assert max_diff(mine[1, 4:], alone[0]) <= TOL


def block_mask(prefix: int, length: int) -> torch.Tensor:
    """[1,1,P+L,P+L]: the prefix sees only itself; the block sees everything."""
    n = prefix + length
    mask = torch.ones(1, 1, n, n, dtype=torch.bool)
    mask[..., :prefix, prefix:] = False
    return mask


@torch.no_grad()
def test_dream_kv_prefix_block_bidirectional(dream) -> None:
    ours, ref = dream
    runner = ModelRunner(ours, torch.device("cpu"), kv_slots=64)
    assert runner.pool is not None
    bi = AttentionKind.BIDIRECTIONAL
    prefixes, blocks = [9, 4, 0], [5, 3, 5]
    ids = [random_ids(ours.config.vocab_size, 1, p + n, 10 + r)[0].tolist()
           for r, (p, n) in enumerate(zip(prefixes, blocks, strict=True))]  # fmt: skip
    spans = [runner.pool.reserve(p + n) for p, n in zip(prefixes, blocks, strict=True)]
    # Prefill every row's prefix alone (bidirectional), keeping it.
    for span, p, row in zip(spans, prefixes, ids, strict=True):
        if p:
            runner.run([RowSpec(row[:p], 0, [0], bi, kv=span)])
            span.length = p
    # One flat forward over the blocks, reading the prefixes.
    rows = [
        RowSpec(row[p:], p, list(range(n)), bi, kv=span)
        for row, p, n, span in zip(ids, prefixes, blocks, spans, strict=True)
    ]
    logits = runner.run(rows)
    assert [s.length for s in spans] == prefixes  # what is kept is the caller's call
    for r, (p, n) in enumerate(zip(prefixes, blocks, strict=True)):
        full = block_mask(p, n)
        pos = torch.arange(p + n)[None]
        row = torch.tensor([ids[r]])
        want = ref(input_ids=row, position_ids=pos, attention_mask=float_mask(full))
        assert max_diff(logits[r, :n], want.logits[0, p:]) <= TOL, r


@torch.no_grad()
def test_idlm_causal(idlm) -> None:
    ours, ref = idlm
    ids = random_ids(ours.config.vocab_size, 2, 11, 2)
    pos = torch.arange(11).expand(2, 11)
    causal = torch.ones(11, 11, dtype=torch.bool).tril().expand(2, 1, 11, 11)
    mine = ours.lm_head(ours(ids, pos, causal))
    want = ref(input_ids=ids, position_ids=pos).logits  # Qwen3's own causal mask
    assert max_diff(mine, want) <= TOL
    assert max_diff(ours.lm_head(ours(ids, pos)), want) > 100 * TOL  # teeth


@pytest.mark.parametrize("left", [True, False])
@torch.no_grad()
def test_idlm_padded(idlm, left: bool) -> None:
    ours, ref = idlm
    lengths = [10, 6, 3]
    ids = random_ids(ours.config.vocab_size, 3, 10, 3)
    mask = padded_mask(lengths, 10, causal=True, left=left)
    pos = left_padded_positions(mask[:, 0, -1])
    mine = ours.lm_head(ours(ids, pos, mask))
    want = ref(input_ids=ids, position_ids=pos, attention_mask=float_mask(mask)).logits
    for r, n in enumerate(lengths):
        cols = slice(10 - n, 10) if left else slice(0, n)
        assert max_diff(mine[r, cols], want[r, cols]) <= TOL, r


@torch.no_grad()
def test_idlm_kv_prefix_causal(idlm) -> None:
    ours, ref = idlm
    runner = ModelRunner(ours, torch.device("cpu"), kv_slots=64)
    pool = runner.pool
    assert pool is not None
    causal = AttentionKind.CAUSAL
    prefixes, steps = [8, 3], [4, 2]
    ids = [random_ids(ours.config.vocab_size, 1, p + n, 20 + r)[0].tolist()
           for r, (p, n) in enumerate(zip(prefixes, steps, strict=True))]  # fmt: skip
    spans = [pool.reserve(p + n) for p, n in zip(prefixes, steps, strict=True)]
    # Causal prefill of both prefixes in one flat forward, keeping them.
    runner.run([RowSpec(row[:p], 0, [p - 1], causal, kv=span)
                for row, p, span in zip(ids, prefixes, spans, strict=True)])  # fmt: skip
    for span, p in zip(spans, prefixes, strict=True):
        span.length = p
    # Then the new tokens, causal among themselves and over the prefix, kept too (the AR/ISD
    # step).
    rows = [
        RowSpec(row[p:], p, list(range(n)), causal, kv=span)
        for row, p, n, span in zip(ids, prefixes, steps, spans, strict=True)
    ]
    logits = runner.run(rows)
    for span, p, n in zip(spans, prefixes, steps, strict=True):
        span.length = p + n
    for r, (p, n) in enumerate(zip(prefixes, steps, strict=True)):
        row = torch.tensor([ids[r]])
        want = ref(input_ids=row, position_ids=torch.arange(p + n)[None]).logits[0]
        assert max_diff(logits[r, :n], want[p:]) <= TOL, r
        # The span now equals a fresh causal prefill of prefix + new tokens.
        fresh = pool.reserve(p + n)
        assert fresh is not None
        runner.run([RowSpec(ids[r], 0, [0], causal, kv=fresh)])
        for buf in (pool.k, pool.v):
            kept = buf[:, spans[r].slots(0, p + n)]
            assert max_diff(kept, buf[:, fresh.slots(0, p + n)]) <= 1e-5, r
        pool.free(fresh)


def test_families_expose_decoding_rules() -> None:
    assert DREAM.bidirectional and DREAM.logit_shift and DREAM.attention == "bidirectional"
    assert not SDAR.bidirectional and SDAR.logit_shift and SDAR.attention == "causal"
    assert DREAM.mask_token == "<|mask|>" and SDAR.mask_token == "<|MASK|>"
    assert DREAM.eot_token == SDAR.eot_token == "<|im_end|>"


def test_reference_helper_rejects_nothing_silently(tmp_path: Path) -> None:
    # hf_reference loads strictly: a checkpoint with an extra tensor must fail there too.
    path = write_tiny_idlm(tmp_path / "x")
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    tensors["model.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(RuntimeError, match="extra"):
        hf_reference(path)
