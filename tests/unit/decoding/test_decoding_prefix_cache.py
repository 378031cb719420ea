"""Block-level prefix KV cache (``--kv-cache prefix``) on the embedded tiny LLaDA checkpoint.

Every forward goes through the engine's own batching path (``build_batch`` + ``run_batch``).
The references below never call the denoiser's cache logic: they rebuild "a full forward on
the canvas" and "the current block against prefix K/V computed from the block-start canvas"
directly with the model and a fresh :class:`KVCache`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch

from dllm_serve.decoding.denoise import DenoiseState, LLaDADenoiser
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.engine.batch import build_batch, run_batch
from dllm_serve.models.kv_cache import KVBatch, KVCache
from dllm_serve.models.loader import LoadedModel, load_model

PROMPT = [5, 17, 8, 30, 11, 40, 2]
P = len(PROMPT)
ATOL = 1e-5  # fp32: same math, different matmul shapes (and a masked-out empty prefix)
_CASES = {
    "topk-uniform": {"gen_length": 12, "block_length": 4, "steps": 12},
    "cosine": {"gen_length": 8, "block_length": 4, "steps": 8, "block_schedule": "cosine"},
    "sampled": {"gen_length": 8, "block_length": 4, "steps": 4, "temperature": 1.0, "seed": 4},
    "threshold": {"gen_length": 8, "block_length": 4, "confidence_threshold": 0.2},
    "local-leap": {"gen_length": 8, "block_length": 4, "use_local_leap": True},
    "single-block": {"gen_length": 8, "steps": 4},
}
# Every mode unshifted; the shifted (Dream-style) index rule on a few (the tiny model is slow
# on small CPUs, ~20 ms a forward).
CASES = [pytest.param(case, 0, id=f"{name}-unshifted") for name, case in _CASES.items()] + [
    pytest.param(_CASES[name], 1, id=f"{name}-shifted")
    for name in ("topk-uniform", "threshold", "single-block")
]
CAUSAL_CASES = [
    pytest.param(_CASES["topk-uniform"], 0, id="topk-unshifted"),
    pytest.param(_CASES["local-leap"], 1, id="local-leap-shifted"),
    pytest.param(_CASES["single-block"], 1, id="single-block-shifted"),
]


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model("tiny-llada", device="cpu", dtype="float32")


def denoiser(loaded: LoadedModel, *, cache: bool, shift: int = 0, causal: bool = False):
    factory = functools.partial(KVCache.for_model, loaded.model) if cache else None
    return LLaDADenoiser(
        loaded.mask_id,
        loaded.stop_ids,
        logit_shift=bool(shift),
        bidirectional=not causal,
        kv_cache_factory=factory,
    )


def step_logits(loaded: LoadedModel, algo: LLaDADenoiser, states: list[DenoiseState]):
    specs = [algo.prepare(s) for s in states]
    with torch.inference_mode():
        return specs, run_batch(loaded.model, build_batch(specs, pad_id=loaded.mask_id))


def decode(loaded: LoadedModel, algo: LLaDADenoiser, params: DecodingParams) -> DenoiseState:
    state = algo.init_state(PROMPT, params, "cpu")
    while not state.finished:
        algo.update(state, step_logits(loaded, algo, [state])[1][0])
    return state


def full_logits(loaded: LoadedModel, canvas: torch.Tensor, rows: torch.Tensor, causal: bool):
    """No cache: the whole canvas, logits at ``rows``."""
    n = canvas.numel()
    mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None] if causal else None
    with torch.inference_mode():
        hidden = loaded.model(canvas[None], torch.arange(n)[None], mask)
        return loaded.model.lm_head(hidden[0, rows])


def stale_prefix_logits(
    loaded: LoadedModel, start_canvas: torch.Tensor, canvas: torch.Tensor, c: int, rows
) -> torch.Tensor:
    """``canvas[c:]`` attending to K/V of ``[0, c)`` computed from ``start_canvas``."""
    n = canvas.numel()
    cache = KVCache.for_model(loaded.model)
    with torch.inference_mode():
        loaded.model(
            start_canvas[None], torch.arange(n)[None], kv_cache=KVBatch([cache], write=[c])
        )
        assert cache.length == c
        hidden = loaded.model(canvas[None, c:], torch.arange(c, n)[None], kv_cache=KVBatch([cache]))
        return loaded.model.lm_head(hidden[0, rows - c])


@dataclass
class Check:
    refreshes: int = 0
    cached: int = 0


@pytest.mark.parametrize(("case", "shift"), CASES)
def test_prefix_cache_steps_match_their_references(loaded, case, shift: int) -> None:
    params = DecodingParams(**case)
    algo = denoiser(loaded, cache=True, shift=shift)
    state = algo.init_state(PROMPT, params, "cpu")
    check, start_canvas = Check(), state.canvas.clone()
    while not state.finished:
        lo, hi = state.active_block
        c = lo - shift
        before = state.canvas.clone()
        masked = torch.nonzero(before[lo:hi] == loaded.mask_id).squeeze(1) + lo
        refresh = state.kv_cache is not None and state.kv_cache.length == 0
        if refresh:
            start_canvas = before.clone()
        (spec,), (logits,) = step_logits(loaded, algo, [state])
        if refresh:  # the block's first step: the exact no-cache forward, prefix now cached
            check.refreshes += 1
            assert state.step == 0 and spec.input_ids.numel() == before.numel()
            expected = full_logits(loaded, before, masked - shift, causal=False)
            assert state.kv_cache.length == c  # prompt + completed blocks (− shift)
        else:  # the block's other steps: x[c:] against the block-start prefix
            check.cached += 1
            assert state.step > 0 and spec.input_ids.numel() == before.numel() - c
            assert spec.positions[0].item() == c and spec.kv_write == 0
            expected = stale_prefix_logits(loaded, start_canvas, before, c, masked - shift)
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
        # Only committed positions are ever cached, and they are those of the block start.
        assert state.kv_cache.length <= c
        assert not (before[: state.kv_cache.length] == loaded.mask_id).any()
        assert torch.equal(start_canvas[:c], before[:c])
        k = state.schedule[state.step] if params.mode == "topk" else None
        result = algo.update(state, logits)
        after = state.canvas
        changed = torch.nonzero(before != after).squeeze(1)
        assert torch.all((changed >= lo) & (changed < hi))  # locality; prompt untouched
        assert torch.all(before[changed] == loaded.mask_id)  # never uncommit
        assert not (after[changed] == loaded.mask_id).any()  # the mask id is never emitted
        assert result.committed == changed.numel() >= (1 if k is None else k)
        if k is not None:
            assert result.committed == k
    assert state.canvas[:P].tolist() == PROMPT
    assert state.kv_cache is None and state.kv_cache_bytes == 0  # released when finished
    assert check.refreshes == state.block + 1  # one refresh per decoded block
    assert state.nfe == check.refreshes + check.cached


@pytest.mark.parametrize(("case", "shift"), CAUSAL_CASES)
def test_causal_attention_makes_the_cache_exact(loaded, case, shift: int) -> None:
    """Causal prefix K/V never depend on later tokens: cached decoding equals no cache."""
    params = DecodingParams(**case)
    plain = decode(loaded, denoiser(loaded, cache=False, shift=shift, causal=True), params)
    cached = decode(loaded, denoiser(loaded, cache=True, shift=shift, causal=True), params)
    assert torch.equal(cached.canvas, plain.canvas)
    assert cached.nfe == plain.nfe


@pytest.mark.parametrize("shift", [False, True], ids=["unshifted", "shifted"])
def test_one_step_per_block_is_identical_to_no_cache(loaded, shift: bool) -> None:
    """With one step per block every step is a refresh, i.e. the exact full forward."""
    params = DecodingParams(gen_length=8, block_length=2, steps=4)
    plain = decode(loaded, denoiser(loaded, cache=False, shift=shift), params)
    cached = decode(loaded, denoiser(loaded, cache=True, shift=shift), params)
    assert torch.equal(cached.canvas, plain.canvas)


def test_cache_reserves_the_last_prefix_once(loaded) -> None:
    params = DecodingParams(gen_length=16, block_length=4, steps=16)
    algo = denoiser(loaded, cache=True)
    state = algo.init_state(PROMPT, params, "cpu")
    cache = state.kv_cache
    assert cache is not None and cache.capacity == P + 16 - 4 and cache.length == 0
    nbytes = state.kv_cache_bytes
    assert nbytes == cache.nbytes > 0
    while not state.finished:
        held = state.kv_cache
        algo.update(state, step_logits(loaded, algo, [state])[1][0])
        assert held is cache and held.nbytes == nbytes  # never reallocated
    assert state.kv_cache is None


def test_early_stop_with_the_cache(loaded) -> None:
    """A confident stop id in block 1 ends the request there, and the cache is released."""
    params = DecodingParams(gen_length=16, block_length=4, steps=16)
    algo = denoiser(loaded, cache=True)
    state = algo.init_state(PROMPT, params, "cpu")
    eos = loaded.stop_ids[0]
    while not state.finished:
        lo, hi = state.active_block
        masked = torch.nonzero(state.canvas[lo:hi] == loaded.mask_id).squeeze(1) + lo
        logits = step_logits(loaded, algo, [state])[1][0].clone()
        logits[:, eos] = torch.where(masked >= P + 4, 1e4, -1e4)  # blocks 1.. are all EOS
        algo.update(state, logits)
    assert state.finish_reason == "stop" and state.block == 1
    # Block 0 takes 4 steps; block 1's first commits its leading EOS, which ends the answer.
    assert state.nfe == 5 and state.kv_cache is None


def test_rows_with_and_without_caches_share_a_forward(loaded) -> None:
    """Cached rows of different prefix lengths and plain rows, in one padded forward."""
    plain, cached = denoiser(loaded, cache=False), denoiser(loaded, cache=True)
    shifted = denoiser(loaded, cache=True, shift=True)
    jobs = [
        (plain, [9, 10, 11], DecodingParams(gen_length=8, block_length=4, steps=8)),
        (cached, PROMPT, DecodingParams(gen_length=12, block_length=4, steps=12)),
        (cached, [3, 4], DecodingParams(gen_length=9, block_length=3, steps=9)),
        (cached, PROMPT[:5], DecodingParams(gen_length=8, confidence_threshold=0.3)),
        (shifted, [7, 8, 9, 10], DecodingParams(gen_length=8, block_length=2, steps=8)),
    ]
    alone = []
    for algo, prompt, params in jobs:
        state = algo.init_state(prompt, params, "cpu")
        while not state.finished:
            algo.update(state, step_logits(loaded, algo, [state])[1][0])
        alone.append(state.canvas)
    states = [algo.init_state(prompt, params, "cpu") for algo, prompt, params in jobs]
    widths = set()
    while not all(s.finished for s in states):
        live = [(a, s) for (a, _, _), s in zip(jobs, states, strict=True) if not s.finished]
        specs = [a.prepare(s) for a, s in live]
        widths.add(tuple(sorted(int(sp.kv_cache.length) if sp.kv_cache else -1 for sp in specs)))
        with torch.inference_mode():
            logits = run_batch(loaded.model, build_batch(specs, pad_id=loaded.mask_id))
        for (a, s), row in zip(live, logits, strict=True):
            a.update(s, row)
    assert [s.canvas.tolist() for s in states] == [c.tolist() for c in alone]
    assert any(len({w for w in ws if w > 0}) > 1 for ws in widths)  # mixed prefix lengths
