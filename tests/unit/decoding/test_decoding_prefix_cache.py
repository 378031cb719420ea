"""Block-level prefix KV cache (``--kv-cache prefix``) on the embedded tiny LLaDA checkpoint.

Every forward goes through the engine's own path (``ModelRunner.run``: flat batch, K/V in the
KV pool, then the batched ``sample`` and ``commit``). The references below never touch the
pool or the denoiser's cache logic: they are padded forwards of the model with an explicit
mask — "a full forward on the canvas", and "the current block against the prefix of the
block-start canvas", the latter as one forward over ``[start canvas ; canvas[c:]]`` whose
second part sees only the first part's ``[0, c)`` and itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from dllm_serve.decoding.blocks import DenoiseState
from dllm_serve.decoding.canvas import LLaDADenoiser
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.decoding.protocol import RowSpec, StepResult
from dllm_serve.engine.model_runner import ModelRunner
from dllm_serve.models.loader import LoadedModel, load_model

PROMPT = [5, 17, 8, 30, 11, 40, 2]
P = len(PROMPT)
ATOL = 1e-5  # fp32: same math, different matmul shapes
SLOTS = 256

pytestmark = pytest.mark.usefixtures("one_thread")
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


@pytest.fixture
def runner(loaded: LoadedModel) -> ModelRunner:
    return ModelRunner(loaded.model, torch.device("cpu"), kv_slots=SLOTS)


def denoiser(loaded: LoadedModel, *, cache: bool, shift: int = 0, causal: bool = False):
    return LLaDADenoiser(
        loaded.mask_id,
        loaded.stop_ids,
        logit_shift=bool(shift),
        bidirectional=not causal,
        prefix_cache=cache,
    )


def admit(
    runner: ModelRunner, algo: LLaDADenoiser, prompt: list[int], params: DecodingParams
) -> DenoiseState:
    """What the engine does at admission: the state, then (with a cache) its KV span."""
    state = algo.init_state(prompt, params, "cpu")
    need = algo.kv_tokens(len(prompt), params)
    if need:
        assert runner.pool is not None
        state.kv = runner.pool.reserve(need)
        assert state.kv is not None
    return state


def forward(runner: ModelRunner, algo: LLaDADenoiser, states: list[DenoiseState]):
    """One forward for ``states``: their rows and logits ``[R, M, V]``."""
    specs = [algo.prepare(s) for s in states]
    return specs, runner.run(specs)


def apply(algo: LLaDADenoiser, states: list[DenoiseState], logits) -> list[StepResult]:
    """The engine's sample (which consumes ``logits``) → one host copy → commit, in inference
    mode as on the engine thread."""
    with torch.inference_mode():
        return algo.commit(states, algo.sample(states, logits).tolist())


def decode(
    runner: ModelRunner, algo: LLaDADenoiser, params: DecodingParams, prompt=PROMPT
) -> DenoiseState:
    state = admit(runner, algo, prompt, params)
    while not state.finished:
        apply(algo, [state], forward(runner, algo, [state])[1])
    if state.kv is not None:  # what the engine does when a request ends
        assert runner.pool is not None
        runner.pool.free(state.kv)
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
    """``canvas[c:]`` attending to the K/V of ``[0, c)`` computed from ``start_canvas``.

    One padded forward of ``[start_canvas ; canvas[c:]]`` at positions ``[0, n) ; [c, n)``:
    the first part attends to itself only (it *is* the block-start full forward, so its
    ``[0, c)`` K/V in every layer are the stale prefix), the second part to the first part's
    ``[0, c)`` and to itself (bidirectionally).
    """
    n = canvas.numel()
    m = n - c
    ids = torch.cat([start_canvas, canvas[c:]])[None]
    positions = torch.cat([torch.arange(n), torch.arange(c, n)])[None]
    mask = torch.zeros(n + m, n + m, dtype=torch.bool)
    mask[:n, :n] = True
    mask[n:, :c] = True
    mask[n:, n:] = True
    with torch.inference_mode():
        hidden = loaded.model(ids, positions, mask[None, None])
        return loaded.model.lm_head(hidden[0, n + rows - c])


@dataclass
class Check:
    refreshes: int = 0
    cached: int = 0


@pytest.mark.parametrize(("case", "shift"), CASES)
def test_prefix_cache_steps_match_their_references(loaded, runner, case, shift: int) -> None:
    params = DecodingParams(**case)
    algo = denoiser(loaded, cache=True, shift=shift)
    state = admit(runner, algo, PROMPT, params)
    span = state.kv
    assert span is not None
    check, start_canvas = Check(), state.canvas.clone()
    while not state.finished:
        lo, hi = state.active_block
        c = lo - shift
        before = state.canvas.clone()
        masked = torch.nonzero(before[lo:hi] == loaded.mask_id).squeeze(1) + lo
        refresh = span.length == 0
        if refresh:
            start_canvas = before.clone()
        (spec,), logits = forward(runner, algo, [state])
        assert spec.kv is span
        got = logits[0, : masked.numel()]
        if refresh:  # the block's first step: the exact no-cache forward
            check.refreshes += 1
            assert state.step == 0 and len(spec.tokens) == before.numel() and spec.start == 0
            expected = full_logits(loaded, before, masked - shift, causal=False)
        else:  # the block's other steps: x[c:] against the block-start prefix
            check.cached += 1
            assert state.step > 0 and len(spec.tokens) == before.numel() - c
            assert spec.start == c and spec.positions[0].item() == c
            expected = stale_prefix_logits(loaded, start_canvas, before, c, masked - shift)
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
        k = state.schedule[state.step] if params.mode == "topk" else None
        (result,) = apply(algo, [state], logits)
        if not state.finished and state.active_block[0] == lo:  # still in this block
            assert span.length == c  # prompt + completed blocks (− shift), kept after a refresh
        # Only committed positions are ever cached, and they are those of the block start.
        assert span.length <= c
        assert not (before[: span.length] == loaded.mask_id).any()
        assert torch.equal(start_canvas[:c], before[:c])
        after = state.canvas
        changed = torch.nonzero(before != after).squeeze(1)
        assert torch.all((changed >= lo) & (changed < hi))  # locality; prompt untouched
        assert torch.all(before[changed] == loaded.mask_id)  # never uncommit
        assert not (after[changed] == loaded.mask_id).any()  # the mask id is never emitted
        assert result.committed == changed.numel() >= (1 if k is None else k)
        if k is not None:
            assert result.committed == k
    assert state.canvas[:P].tolist() == PROMPT
    assert state.kv is span and span.reserved == runner.pool.pages_for(P + params.gen_length)
    assert check.refreshes == state.block + 1  # one refresh per decoded block
    assert state.nfe == check.refreshes + check.cached


@pytest.mark.parametrize(("case", "shift"), CAUSAL_CASES)
def test_causal_attention_makes_the_cache_exact(loaded, runner, case, shift: int) -> None:
    """Causal prefix K/V never depend on later tokens: cached decoding equals no cache."""
    params = DecodingParams(**case)
    plain = decode(runner, denoiser(loaded, cache=False, shift=shift, causal=True), params)
    cached = decode(runner, denoiser(loaded, cache=True, shift=shift, causal=True), params)
    assert (
        plain.kv is None
        and cached.kv is not None
        and runner.pool.reserved_pages == runner.pool.pages_used == 0
    )
    assert torch.equal(cached.canvas, plain.canvas)
    assert cached.nfe == plain.nfe


@pytest.mark.parametrize("shift", [False, True], ids=["unshifted", "shifted"])
def test_one_step_per_block_is_identical_to_no_cache(loaded, runner, shift: bool) -> None:
    """With one step per block every step is a refresh, i.e. the exact full forward."""
    params = DecodingParams(gen_length=8, block_length=2, steps=4)
    plain = decode(runner, denoiser(loaded, cache=False, shift=shift), params)
    cached = decode(runner, denoiser(loaded, cache=True, shift=shift), params)
    assert torch.equal(cached.canvas, plain.canvas)


def test_span_is_reserved_once_and_holds_the_prefix(loaded, runner) -> None:
    """One span of the whole canvas at admission, never reallocated; kept length 0 at each
    block's refresh, then the committed prefix, whose K/V (keys after RoPE) stay those of the
    refresh forward while the block's cached steps write past it."""
    params = DecodingParams(gen_length=16, block_length=4, steps=16)
    algo = denoiser(loaded, cache=True)
    assert algo.kv_tokens(P, params) == P + 16
    assert denoiser(loaded, cache=False).kv_tokens(P, params) == 0
    state = admit(runner, algo, PROMPT, params)
    span, pool = state.kv, runner.pool
    assert span is not None and pool is not None
    assert (span.reserved, span.length) == (pool.pages_for(P + 16), 0)
    assert pool.reserved_pages == span.reserved
    block_start = state.canvas
    checked = 0
    while not state.finished:
        if span.length == 0:
            block_start = state.canvas
        apply(algo, [state], forward(runner, algo, [state])[1])
        assert state.kv is span and pool.reserved_pages == span.reserved == pool.pages_for(P + 16)
        if state.finished or span.length == 0:
            continue
        assert span.length == state.active_block[0]
        fresh = pool.reserve(block_start.numel())
        assert fresh is not None
        runner.run([RowSpec(block_start.tolist(), 0, [0], kv=fresh)])
        kept = span.slots(0, span.length)
        want = fresh.slots(0, span.length)
        torch.testing.assert_close(pool.k[:, kept], pool.k[:, want], atol=ATOL, rtol=0)
        torch.testing.assert_close(pool.v[:, kept], pool.v[:, want], atol=ATOL, rtol=0)
        pool.free(fresh)
        checked += 1
    assert checked >= 8  # three steps after each of the first three refreshes
    pool.free(span)
    assert pool.reserved_pages == pool.pages_used == 0 and span.reserved == 0


def test_early_stop_with_the_cache(loaded, runner) -> None:
    """A confident stop id in block 1 ends the request there."""
    params = DecodingParams(gen_length=16, block_length=4, steps=16)
    algo = denoiser(loaded, cache=True)
    state = admit(runner, algo, PROMPT, params)
    eos = loaded.stop_ids[0]
    while not state.finished:
        lo, hi = state.active_block
        masked = torch.nonzero(state.canvas[lo:hi] == loaded.mask_id).squeeze(1) + lo
        logits = forward(runner, algo, [state])[1].as_padded().clone()
        logits[0, : masked.numel(), eos] = torch.where(masked >= P + 4, 1e4, -1e4)  # blocks 1..
        apply(algo, [state], logits)
    assert state.finish_reason == "stop" and state.block == 1
    # Block 0 takes 4 steps; block 1's first commits its leading EOS, which ends the answer.
    assert state.nfe == 5


def test_cached_rows_of_different_prefixes_share_a_forward(loaded, runner) -> None:
    """Cached rows at different blocks and prefix lengths (equal and ragged ones in one
    attention group), shifted and unshifted, in one flat forward: each as alone."""
    cached, shifted = denoiser(loaded, cache=True), denoiser(loaded, cache=True, shift=True)
    lockstep = DecodingParams(gen_length=8, block_length=4, steps=8)
    jobs = [
        (cached, PROMPT, DecodingParams(gen_length=12, block_length=4, steps=12)),
        (cached, [3, 4], DecodingParams(gen_length=9, block_length=3, steps=9)),
        (cached, PROMPT[:5], DecodingParams(gen_length=8, confidence_threshold=0.3)),
        (shifted, [7, 8, 9, 10], DecodingParams(gen_length=8, block_length=2, steps=8)),
        # Same lengths, same schedule: equal row lengths with ragged prefixes ...
        (cached, [21, 22, 23], lockstep),
        (cached, [24, 25, 26, 27, 28], lockstep),
        # ... and with equal prefixes (a row length no other row has).
        (cached, [29, 30, 31], DecodingParams(gen_length=10, block_length=5, steps=10)),
        (cached, [32, 33, 34], DecodingParams(gen_length=10, block_length=5, steps=10)),
    ]
    alone = [decode(runner, algo, params, prompt).canvas for algo, prompt, params in jobs]
    states = [admit(runner, algo, prompt, params) for algo, prompt, params in jobs]
    prefixes, shared = set(), set()
    while not all(s.finished for s in states):
        live = [(a, s) for (a, _, _), s in zip(jobs, states, strict=True) if not s.finished]
        specs = [a.prepare(s) for a, s in live]
        prefixes.add(tuple(sp.start for sp in specs))
        # Rows of one length share an attention group (the scheduler's order).
        order = sorted(range(len(live)), key=lambda i: len(specs[i].tokens))
        live, specs = [live[i] for i in order], [specs[i] for i in order]
        logits = runner.run(specs)
        assert runner.last_batch is not None
        for g in runner.last_batch.groups:
            if g.kv_slots is not None and g.rows > 1:  # several cached rows in one SDPA call
                shared.add("ragged" if g.mask is not None else "equal")
        for algo in (cached, shifted):
            idx = [i for i, (a, _) in enumerate(live) if a is algo]
            if idx:
                apply(algo, [live[i][1] for i in idx], logits[idx])
    assert [s.canvas.tolist() for s in states] == [c.tolist() for c in alone]
    assert any(len({p for p in ps if p > 0}) > 1 for ps in prefixes)  # mixed prefix lengths
    assert shared == {"ragged", "equal"}  # both kinds of shared prefix groups ran


def test_rows_with_and_without_a_span_cannot_share_a_forward(loaded, runner) -> None:
    plain, cached = denoiser(loaded, cache=False), denoiser(loaded, cache=True)
    params = DecodingParams(gen_length=8, block_length=4, steps=8)
    rows = [plain.prepare(admit(runner, plain, PROMPT, params))]
    rows.append(cached.prepare(admit(runner, cached, PROMPT, params)))
    with pytest.raises(ValueError, match="KV cache"):
        runner.run(rows)
