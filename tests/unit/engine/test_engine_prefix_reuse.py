"""Prefix reuse across requests, through the engine, for every family where it is exact (the
tiny checkpoints of I-DLM, SDAR block diffusion, LLaDA2.x, Fast-dLLM v2 and the tri-mode model
in each of its modes): the answers are token for token those of the engine without the cache
(T = 0 and seeded sampling), the model is fed exactly the hit fewer tokens, ``cached_tokens``
is the hit and the counters move; pages come back idle after a run with aborts; a small pool
evicts without changing an answer and never evicts a pinned page. LLaDA/Dream canvas
denoising reuses prefixes only on request, behind ``--kv-cache prefix`` (approximate).
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
from prefix_driver import Counts, answers, hand_engine, request, run

from dllm_serve.decoding.params import DecodingParams
from dllm_serve.engine.engine import AsyncEngine
from dllm_serve.models.kv_pool import PAGE_SIZE, KVPool
from dllm_serve.models.loader import LoadedModel, load_model
from dllm_serve_train.tiny_checkpoints import write_tiny

pytestmark = pytest.mark.usefixtures("one_thread")

# (family, writer options, decoding mode): every exact family, the tri-mode model in each mode.
CASES = [
    ("idlm", {}, None),
    ("sdar", {}, None),
    ("llada2", {}, None),
    ("fastdllm", {}, None),
    ("nemotron", {"block_size": 8, "seed": 1}, "ar"),
    ("nemotron", {"block_size": 8, "seed": 1}, "diffusion"),
    ("nemotron", {"block_size": 8, "seed": 1}, "linear_spec"),
]
IDS = [f"{f}-{m}" if m else f for f, _, m in CASES]
SHARED = 96  # the system prompt: whole chunks for every family (pages of 16, blocks up to 32)
USERS = 16


def tokens(rng: random.Random, n: int) -> list[int]:
    # Ids every tiny vocabulary holds that are no mask or stop id of any family.
    return [rng.randrange(200, 700) for _ in range(n)]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoadedModel]:
    root = Path(tmp_path_factory.mktemp("tiny"))
    out = {}
    for family, options, _ in CASES:
        if family not in out:
            path = write_tiny(family, root / family, **options)
            out[family] = load_model(str(path), device="cpu", dtype="float32")
    return out


def params(mode: str | None, seed: int | None = None, gen_length: int = 24) -> DecodingParams:
    sampled = {"temperature": 0.8, "seed": seed} if seed is not None else {}
    return DecodingParams(gen_length=gen_length, ignore_eos=True, decoding_mode=mode, **sampled)  # type: ignore[arg-type]


def idle(engine: AsyncEngine) -> None:
    """Nothing reserved, pinned or held: every page is free or cached and idle."""
    pool = engine.runner.pool
    assert pool is not None
    cache = pool.cache
    assert pool.reserved_pages == 0 and pool.pages_used == 0
    assert pool.free_pages == pool.num_pages
    if cache is not None:
        assert cache.pinned_pages == 0
        assert len(pool._free) + cache.idle_pages == pool.num_pages


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize(("family", "options", "mode"), CASES, ids=IDS)
def test_sixteen_requests_sharing_a_system_prompt_answer_the_same_and_skip_its_prefill(
    models: dict[str, LoadedModel], family: str, options: dict, mode: str | None, sampled: bool
) -> None:
    rng = random.Random(7)
    system = tokens(rng, SHARED)
    # Each user's message starts with its own token: no two prompts share more than the system.
    prompts = [[*system, 200 + i, *tokens(rng, 3 + i % 5)] for i in range(USERS)]
    every = [params(mode, 1000 + i if sampled else None) for i in range(USERS)]
    got: dict[bool, tuple[list[list[int]], Counts, list[int]]] = {}
    for on in (False, True):
        engine, counts = hand_engine(models[family], enable_prefix_caching=on)
        assert (engine.prefix_cache is not None) is on
        # The first request fills the cache; the other fifteen arrive together after it.
        first = run(engine, prompts[:1], every[:1], prefix="a")
        rest = run(engine, prompts[1:], every[1:], prefix="b")
        got[on] = (answers(first + rest), counts, [r.cached_tokens for r in first + rest])
        idle(engine)
    (off, off_counts, off_cached), (on_, on_counts, on_cached) = got[False], got[True]
    assert on_ == off  # token for token
    assert off_cached == [0] * USERS and off_counts.queries == off_counts.hits == 0
    assert on_cached == [0] + [SHARED] * (USERS - 1)
    assert on_counts.hits == sum(on_cached) == SHARED * (USERS - 1)
    assert on_counts.queries == sum(len(p) for p in prompts)
    # The model is fed exactly the hit fewer tokens: the acceptance's lower bound, with equality.
    saved = off_counts.forward_tokens - on_counts.forward_tokens
    assert saved == on_counts.hits >= SHARED * (USERS - 1)
    # The usage a client sees says the same.
    assert [o.cached_tokens for o in on_counts.finished] == on_cached


@pytest.mark.parametrize(("family", "options", "mode"), CASES, ids=IDS)
def test_a_four_turn_conversation_hits_its_whole_history_and_answers_the_same(
    models: dict[str, LoadedModel], family: str, options: dict, mode: str | None
) -> None:
    turns: dict[bool, list[tuple[list[int], list[int], int]]] = {}
    saved = {}
    for on in (False, True):
        engine, counts = hand_engine(models[family], enable_prefix_caching=on)
        rng = random.Random(3)
        prompt = tokens(rng, SHARED) + tokens(rng, 9)
        history = []
        for turn in range(4):
            (req,) = run(engine, [prompt], params(mode, gen_length=40), prefix=f"t{turn}")
            answer = answers([req])[0]
            history.append((prompt, answer, req.cached_tokens))
            # The next turn resends everything: this prompt, this answer, a new message.
            prompt = prompt + answer + tokens(rng, 7)
        turns[on] = history
        saved[on] = counts
        idle(engine)
    assert [(p, a) for p, a, _ in turns[True]] == [(p, a) for p, a, _ in turns[False]]
    assert all(c == 0 for _, _, c in turns[False])
    cache = turns[True]
    chunk = 32 if family in ("llada2", "fastdllm") else PAGE_SIZE  # their blocks are 32
    assert cache[0][2] == 0
    for (before, _, _), (prompt, _, hit) in itertools.pairwise(cache):
        assert hit % chunk == 0 and hit < len(prompt)
        # Past the previous turn's prompt: its committed answer blocks were cached too.
        assert hit >= (len(before) // chunk + 1) * chunk
    hits = sum(c for _, _, c in cache)
    assert saved[True].hits == hits
    assert saved[False].forward_tokens - saved[True].forward_tokens == hits


@pytest.mark.parametrize(("family", "options", "mode"), CASES[1:4], ids=IDS[1:4])
def test_a_hit_never_ends_inside_a_block(
    models: dict[str, LoadedModel], family: str, options: dict, mode: str | None
) -> None:
    """Prompts that share 112 tokens, 16 into a block of 32: a block's K/V depend on all of
    its tokens (bidirectional inside it), so LLaDA2's and Fast-dLLM's hits stop at 96; SDAR's
    blocks of 4 let all 112 be reused. Answers as without the cache either way."""
    rng = random.Random(13)
    shared = tokens(rng, 112)
    prompts = [[*shared, 500 + i, *tokens(rng, 30)] for i in range(4)]
    block = models[family].block_size
    assert block is not None
    got = {}
    for on in (False, True):
        engine, _ = hand_engine(models[family], enable_prefix_caching=on)
        first = run(engine, prompts[:1], params(mode), prefix="a")
        rest = run(engine, prompts[1:], params(mode), prefix="b")
        got[on] = answers(first + rest), [r.cached_tokens for r in rest]
    assert got[True][0] == got[False][0]
    assert got[True][1] == [112 // block * block] * 3 == [96 if block == 32 else 112] * 3


@pytest.mark.parametrize(("family", "options", "mode"), [CASES[0], CASES[2], CASES[6]],
                         ids=[IDS[0], IDS[2], IDS[6]])  # fmt: skip
def test_a_request_arriving_while_another_decodes_hits_its_prompt_at_once(
    models: dict[str, LoadedModel], family: str, options: dict, mode: str | None
) -> None:
    """A request's kept chunks are published as soon as it keeps them (after its prefill),
    not when it ends: one that arrives two steps later reuses them while the first decodes."""
    rng = random.Random(17)
    system = tokens(rng, SHARED)
    first, second = [*system, 600, *tokens(rng, 5)], [*system, 601, *tokens(rng, 9)]
    got = {}
    for on in (False, True):
        engine, counts = hand_engine(models[family], enable_prefix_caching=on)
        a = request(engine, "a", first, params(mode, gen_length=40))
        b = request(engine, "b", second, params(mode, gen_length=40))
        engine.inbox.requests.append(a)
        engine.step()
        engine.step()
        assert a.state is not None and not a.state.finished
        engine.inbox.requests.append(b)
        while engine.scheduler.running or engine.scheduler.waiting or engine.inbox.requests:
            engine.step()
            if on:
                pinned_pages_are_safe(engine)
        got[on] = answers([a, b]), [a.cached_tokens, b.cached_tokens], counts.forward_tokens
        idle(engine)
    assert got[True][0] == got[False][0]
    assert got[True][1] == [0, SHARED] and got[False][1] == [0, 0]
    assert got[False][2] - got[True][2] == SHARED


def engine_with_pages(
    loaded: LoadedModel, pages: int, **config: object
) -> tuple[AsyncEngine, Counts]:
    cfg = loaded.model.config
    per_slot = KVPool.bytes_per_slot(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, loaded.dtype)
    engine, counts = hand_engine(
        loaded, kv_cache_memory=pages * PAGE_SIZE * per_slot / 2**30, **config
    )
    assert engine.runner.pool is not None and engine.runner.pool.num_pages == pages
    return engine, counts


def pinned_pages_are_safe(engine: AsyncEngine) -> None:
    """Every running request's hit is cached, pinned and not free; no page is in two places."""
    pool = engine.runner.pool
    assert pool is not None and pool.cache is not None
    free = set(pool._free)
    assert len(free) == len(pool._free)
    cached = {p for chunk in pool.cache._chunks.values() for p in chunk.pages}
    held: set[int] = set()
    for running in engine.scheduler.running:
        kv = running.state.kv  # type: ignore[union-attr]
        shared, own = set(kv.pages[: kv.shared]), set(kv.pages[kv.shared :])
        assert shared <= cached and not shared & free
        assert not own & cached and not own & free and not own & held
        held |= own
    assert not cached & free


@pytest.mark.parametrize(("family", "options", "mode"), [CASES[0], CASES[2], CASES[6]],
                         ids=[IDS[0], IDS[2], IDS[6]])  # fmt: skip
def test_a_small_pool_evicts_idle_chunks_only_and_no_answer_changes(
    models: dict[str, LoadedModel], family: str, options: dict, mode: str | None
) -> None:
    """Three system prompts, requests in waves through a pool of two contexts: the cache
    must evict (it cannot keep every prompt), answers stay those of the uncached engine, and
    after every step no pinned page is free or held by a request as its own."""
    rng = random.Random(11)
    systems = [tokens(rng, SHARED) for _ in range(3)]
    waves = [
        [systems[(w + i) % 3] + [300 + 10 * w + i] + tokens(rng, 4) for i in range(3)]
        for w in range(5)
    ]
    loaded = models[family]
    p = params(mode, gen_length=24)
    need = engine_with_pages(loaded, 64)[0].algorithm.kv_tokens(SHARED + 5, p)
    pages = 2 * -(-need // PAGE_SIZE) + 2  # two running requests and little room to cache
    results = {}
    for on in (False, True):
        engine, counts = engine_with_pages(loaded, pages, enable_prefix_caching=on)
        check = (lambda e=engine: pinned_pages_are_safe(e)) if on else None
        results[on] = [answers(run(engine, w, p, prefix=f"w{i}", each_step=check))
                       for i, w in enumerate(waves)]  # fmt: skip
        idle(engine)
        if on:
            assert engine.prefix_cache is not None and engine.prefix_cache.evicted_pages > 0
            assert counts.hits > 0
    assert results[True] == results[False]


@pytest.mark.parametrize(("family", "options", "mode"), [CASES[0], CASES[3], CASES[5]],
                         ids=[IDS[0], IDS[3], IDS[5]])  # fmt: skip
def test_pages_come_back_idle_after_a_load_run_with_aborts(
    models: dict[str, LoadedModel], family: str, options: dict, mode: str | None
) -> None:
    rng = random.Random(5)
    system = tokens(rng, SHARED)
    prompts = [[*system, 400 + i, *tokens(rng, 2 + i % 4)] for i in range(20)]
    engine, counts = hand_engine(models[family], enable_prefix_caching=True, max_running_requests=6)
    run(engine, prompts[:1], params(mode), prefix="warm")
    # Aborted while waiting, right after admission, and mid-answer.
    abort = {"x3": 0, "x10": 0, "x0": 1, "x4": 2, "x7": 5, "x12": 9}
    requests = run(
        engine, prompts, params(mode, gen_length=32), prefix="x", abort=abort,
        each_step=lambda: pinned_pages_are_safe(engine),
    )  # fmt: skip
    ended = {o.request_id: o.finish_reason for o in counts.finished}
    assert all(ended[name] == "abort" for name in abort)
    assert all(ended[f"x{i}"] == "length" for i in range(20) if f"x{i}" not in abort)
    started = [r for r in requests if r.state is not None]
    assert "x3" not in {r.request_id for r in started}  # aborted while it waited
    # Every request that started hit the system prompt, aborted ones included.
    assert [r.cached_tokens for r in started] == [SHARED] * len(started)
    assert counts.hits == SHARED * len(started) and len(started) >= 17
    idle(engine)
    assert engine.prefix_cache is not None and engine.prefix_cache.idle_pages > 0


def test_canvas_denoising_reuses_prefixes_only_on_request_behind_the_kv_cache(
    tmp_path: Path,
) -> None:
    """LLaDA canvas denoising: off by default (reuse is approximate), refused without
    ``--kv-cache prefix`` (no K/V to reuse), opt-in with it. Then sixteen requests sharing a
    system prompt hit it in whole pages (each refresh forwards the canvas past the hit, so the
    model is fed at least the hit fewer tokens per block), the first request — which hit
    nothing — answers as without the cache, a running request publishes nothing (its
    refreshes rewrite its kept K/V) and every page comes back idle."""
    llada = load_model("tiny-llada", device="cpu", dtype="float32")
    assert hand_engine(llada)[0].prefix_cache is None
    assert hand_engine(llada, kv_cache="prefix")[0].prefix_cache is None
    with pytest.raises(ValueError, match="cannot reuse prefixes across requests"):
        hand_engine(llada, enable_prefix_caching=True)
    rng = random.Random(3)
    system = tokens(rng, SHARED)
    prompts = [[*system, 200 + i, *tokens(rng, 3 + i % 5)] for i in range(USERS)]
    got = {}
    for on in (False, True):
        engine, counts = hand_engine(
            llada, kv_cache="prefix", enable_prefix_caching=True if on else None
        )
        assert (engine.prefix_cache is not None) is on
        first = run(engine, prompts[:1], params(None), prefix="a")
        if on:
            assert engine.prefix_cache is not None and len(engine.prefix_cache) == SHARED // 16
        rest = run(engine, prompts[1:], params(None), prefix="b")
        got[on] = (answers(first + rest), counts, [r.cached_tokens for r in first + rest])
        idle(engine)
    (off, off_counts, _), (on_, on_counts, on_cached) = got[False], got[True]
    assert on_[0] == off[0]  # no hit: exactly the per-request cache's answer
    assert on_cached[0] == 0 and all(c >= SHARED for c in on_cached[1:])
    assert all(c % PAGE_SIZE == 0 for c in on_cached)
    saved = off_counts.forward_tokens - on_counts.forward_tokens
    assert saved >= sum(on_cached)  # at least once per request: its first block's refresh


def test_the_flag_turns_it_off(models: dict[str, LoadedModel]) -> None:
    idlm = models["idlm"]
    on = hand_engine(idlm)[0].prefix_cache
    assert on is not None and not on.copy_hits  # on by default where exact; pages shared
    assert hand_engine(idlm, enable_prefix_caching=False)[0].prefix_cache is None


@pytest.mark.parametrize(("family", "options", "mode"), [CASES[0], CASES[2], CASES[6]],
                         ids=[IDS[0], IDS[2], IDS[6]])  # fmt: skip
def test_the_flex_backend_copies_hits_into_pages_of_the_requests_own(
    models: dict[str, LoadedModel], family: str, options: dict, mode: str | None
) -> None:
    """FlexAttention's mask gives each page one owner, so with it a hit is copied, not
    shared: the same answers as flex without the cache (and as SDPA), the hit's prefill
    saved, no page shared, and a hit costs its pages."""
    rng = random.Random(19)
    system = tokens(rng, SHARED)
    prompts = [[*system, 650 + i, *tokens(rng, 4 + i)] for i in range(4)]
    got = {}
    for backend, on in (("flex", False), ("flex", True), ("sdpa", True)):
        engine, counts = hand_engine(
            models[family], enable_prefix_caching=on, attention_backend=backend
        )
        assert (engine.prefix_cache is not None) is on
        if on:
            assert engine.prefix_cache is not None
            assert engine.prefix_cache.copy_hits is (backend == "flex")

        def no_page_shared(e: AsyncEngine = engine) -> None:
            assert all(r.state.kv.shared == 0 for r in e.scheduler.running)  # type: ignore[union-attr]

        check = no_page_shared if backend == "flex" else None
        first = run(engine, prompts[:1], params(mode), prefix="a")
        rest = run(engine, prompts[1:], params(mode), prefix="b", each_step=check)
        got[backend, on] = answers(first + rest), counts.hits, counts.forward_tokens
        idle(engine)
    assert got["flex", True][0] == got["flex", False][0] == got["sdpa", True][0]
    assert got["flex", True][1] == got["sdpa", True][1] == 3 * SHARED
    assert got["flex", False][2] - got["flex", True][2] == 3 * SHARED


def test_the_flags_are_vllms() -> None:
    from dllm_serve.cli import parse_config

    assert parse_config([]).engine.enable_prefix_caching is None  # on where exact
    assert parse_config(["--enable-prefix-caching"]).engine.enable_prefix_caching is True
    assert parse_config(["--no-enable-prefix-caching"]).engine.enable_prefix_caching is False


def test_diffusion_gemma_reuses_its_causal_encoders_prompt(tmp_path: Path) -> None:
    """DiffusionGemma's encoder is causal: requests sharing a system prompt take its K/V from
    the cache and answer (seeded) exactly as without it, fed exactly the hit fewer tokens."""
    from dllm_serve_train.tiny_checkpoints import write_tiny_diffusion_gemma

    path = write_tiny_diffusion_gemma(tmp_path / "dg", canvas_length=16, seed=2)
    loaded = load_model(str(path), device="cpu", dtype="float32")
    rng = random.Random(5)
    system = tokens(rng, SHARED)
    prompts = [[*system, 200 + i, *tokens(rng, 4)] for i in range(4)]
    every = [DecodingParams(gen_length=20, steps=6, seed=50 + i) for i in range(4)]
    got = {}
    for on in (False, True):
        engine, counts = hand_engine(loaded, enable_prefix_caching=on)
        first = run(engine, prompts[:1], every[:1], prefix="a")
        rest = run(engine, prompts[1:], every[1:], prefix="b")
        got[on] = (answers(first + rest), counts, [r.cached_tokens for r in first + rest])
        idle(engine)
    assert got[True][0] == got[False][0]
    assert got[True][2] == [0, SHARED, SHARED, SHARED]
    saved = got[False][1].forward_tokens - got[True][1].forward_tokens
    assert saved == got[True][1].hits == 3 * SHARED
