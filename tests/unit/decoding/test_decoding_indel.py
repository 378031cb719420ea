"""LLaDA2.2 insert/delete editing (JointThresholdInDel) on the block-diffusion engine.

The rule (SGLang's ``JointThresholdInDel``), per step of the open block:

- original masks (those the block started with; the flag travels with its token through
  edits) still unresolved ``O``, masks edits introduced ``I``; the step counts one update
  step, and a post-edit step when ``O = 0`` (cumulative);
- the cleanup round when post-edit steps ≥ ``max_post_edit_steps`` (> 0), or ``O = 0`` with a
  zero budget, or update steps > ``block + max_post_edit_steps``: every mask is written and
  nothing written may be MASK, DELETE or SPLIT;
- otherwise M2T takes ``1 + I`` masks (all above τ strictly if that many are, else the most
  confident), or every mask once only introduced ones are left; T2T as LLaDA2.1's;
- a block state seen before redraws the least confident changing position away from every
  token written there before;
- DELETE drops a position, SPLIT opens a mask before the token that was there, and the
  editable part is rebuilt at the block's length (prompt tail untouched);
- nothing written closes the block; the cleanup round closes it too, after one more forward
  of the block when it changed a token.

The scripted cases drive the decoder's own sample/commit with hand-made logits; the engine
must equal a plain no-cache re-statement of the loop on a tiny LLaDA2.2 checkpoint (answers
and forward counts), and each closed block's cached K/V a fresh encode of its final tokens.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from editing_support import SETTINGS, TAU_MASK, prompts
from safetensors.torch import load_file, save_file

from dllm_serve.config import EngineConfig
from dllm_serve.decoding.block_diffusion import BlockDiffusionDecoder, BlockState
from dllm_serve.decoding.commit_rules import InDelCounters, indel_rebuild, indel_step
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.decoding.protocol import AttentionKind, RowSpec, StepLogits
from dllm_serve.engine.model_runner import ModelRunner
from dllm_serve.llm import LLM
from dllm_serve.models.families import UnsupportedModelError
from dllm_serve.models.kv_pool import KVPool
from dllm_serve.models.loader import LoadedModel, load_model
from dllm_serve_train.tiny_checkpoints import write_tiny_llada2

pytestmark = pytest.mark.usefixtures("one_thread")

M, DEL, SPLIT = 99, 97, 98  # the scripted cases' mask and edit tokens
V = 100
A, B, C = 10, 11, 12


# ---- the rebuild and the step rule on scripted values --------------------------------------------


def rebuild(current: list[int], writes: list[int | None]) -> list[int]:
    tokens, _ = indel_rebuild(
        current, [False] * len(current), writes, mask_id=M, delete_id=DEL, split_id=SPLIT
    )
    return tokens


def test_delete_and_split_rebuild_the_block_at_its_length() -> None:
    a, b, c, d = 1, 2, 3, 4
    assert rebuild([a, b, c, d], [None, DEL, None, None]) == [a, c, d, M]
    assert rebuild([a, b, c, d], [None, SPLIT, None, None]) == [a, M, b, c]
    # Other writes of the same step keep their new token; several edits compose left to right.
    assert rebuild([a, b, c, d], [5, DEL, SPLIT, None]) == [5, M, c, d]
    # Provenance travels with the token; SPLIT's new mask is not an original one.
    tokens, flags = indel_rebuild(
        [M, b, M, d], [True, False, True, False], [None, SPLIT, None, DEL],
        mask_id=M, delete_id=DEL, split_id=SPLIT,
    )  # fmt: skip
    assert tokens == [M, M, b, M] and flags == [True, False, False, True]


def step(
    current: list[int],
    proposals: list[int],
    confidence: list[float],
    *,
    original: list[bool] | None = None,
    clean: list[int] | None = None,
    counters: InDelCounters | None = None,
    tau: float = 0.5,
    tau_edit: float = 0.0,
    budget: int = 16,
    seen: bool = False,
    history: list[set[int]] | None = None,
    redraw: Callable[[int, set[int]], int] = lambda i, excluded: -1,
) -> tuple[list[int | None], bool]:
    n = len(current)
    flags = original if original is not None else [t == M for t in current]
    out = indel_step(
        current, flags, proposals, confidence, clean if clean is not None else proposals,
        counters or InDelCounters(), mask_id=M,
        block_size=n, mask_threshold=tau, edit_threshold=tau_edit, max_post_edit_steps=budget,
        seen_before=seen, history=history or [set() for _ in current], redraw=redraw,
    )  # fmt: skip
    return out.writes, out.final


def test_mask_threshold_is_strict_and_needs_one_plus_the_introduced_masks() -> None:
    # Exactly τ is not above it: the single most confident mask (the first of equals).
    assert step([M, M, M], [1, 2, 3], [0.5, 0.5, 0.2]) == ([1, None, None], False)
    assert step([M, M, M], [1, 2, 3], [0.5, 0.6, 0.7]) == ([None, 2, 3], False)
    # One introduced mask (position 1): two masks a step; one above τ is not enough.
    original = [True, False, True, True]
    writes, _ = step([M, M, M, M], [1, 2, 3, 4], [0.9, 0.3, 0.4, 0.2], original=original)
    assert writes == [1, None, 3, None]
    # Only introduced masks left: all of them, whatever their confidence.
    writes, final = step([5, M, M], [5, 2, 3], [0.9, 0.1, 0.1], original=[True, False, False])
    assert writes == [None, 2, 3] and not final


def test_the_final_round_forbids_masks_and_edit_tokens() -> None:
    # The post-edit budget is reached on this step: every mask, and the clean argmax.
    counters = InDelCounters(update_steps=5, post_edit_steps=1)
    writes, final = step(
        [7, M, 8], [DEL, SPLIT, 8], [0.9, 0.1, 0.9], original=[True, False, True],
        clean=[6, 4, 8], counters=counters, budget=2,
    )  # fmt: skip
    assert final and writes == [6, 4, None]
    # The hard cap (update steps > block + budget) also ends the block with original masks left.
    writes, final = step([M, M], [DEL, 3], [0.9, 0.1], clean=[2, 3],
                         counters=InDelCounters(update_steps=18))  # fmt: skip
    assert final and writes == [2, 3]
    # A zero budget: the step that resolves the last original masks is the cleanup round.
    writes, final = step([5, M], [DEL, SPLIT], [0.9, 0.9], clean=[5, 6], budget=0)
    assert final and writes == [5, 6]


def test_a_revisited_state_redraws_away_from_the_written_history() -> None:
    asked: list[tuple[int, set[int]]] = []

    def redraw(i: int, excluded: set[int]) -> int:
        asked.append((i, excluded))
        return 42

    writes, final = step(
        [A, B], [B, A], [0.7, 0.6], seen=True, history=[{A, B}, {B}], redraw=redraw
    )
    assert not final and writes == [B, 42]  # the least confident changing position
    assert asked == [(1, {B, M})]


# ---- the decoder on scripted logits -----------------------------------------------------------


def scripted(model: Callable[[list[int]], list[dict[int, float]]], tokens: list[int]) -> StepLogits:
    """Logits ``[1, n, V]`` whose row i puts the given logits on its tokens (others -10)."""
    rows = model(tokens)
    z = torch.full((1, len(rows), V), -10.0)
    for i, row in enumerate(rows):
        for token, value in row.items():
            z[0, i, token] = value
    return StepLogits.padded(z)


def run_block(
    decoder: BlockDiffusionDecoder,
    state: BlockState,
    model: Callable[[list[int]], list[dict[int, float]]],
    limit: int = 64,
) -> int:
    """Decode the open block (no model: ``model`` gives each editable position's logits from
    the block's editable tokens); the forwards it took."""
    block = state.block
    forwards = 0
    while state.block == block and not state.finished and forwards < limit:
        current = state.tokens[state.editable[0] : state.active_block[1]]
        out = decoder.sample([state], scripted(model, current))
        decoder.commit([state], out.tolist())
        forwards += 1
    return forwards


def block_state(prompt: list[int], block: int, budget: int = 16) -> tuple:
    decoder = BlockDiffusionDecoder(M, [0], block, editing=True, edit_tokens=(DEL, SPLIT))
    params = DecodingParams(gen_length=8, steps=8, edit_threshold=0.0, max_post_edit_steps=budget)
    state = decoder.init_state(prompt, params, "cpu")
    state.phase = "decode"
    decoder._start_block(state)
    pool = KVPool(1, 1, 2, 64)
    state.kv = pool.reserve(decoder.kv_tokens(len(prompt), params))
    state.kv.length = state.active_block[0]
    return decoder, state


def oscillating(tokens: list[int]) -> list[dict[int, float]]:
    """A→B and B→A (confidently), C stays C, a mask becomes A."""
    table = {A: {B: 5.0, A: 4.0, C: 3.0}, B: {A: 5.0, B: 4.0, C: 3.0}, C: {C: 5.0}, M: {A: 5.0}}
    return [table[t] for t in tokens]


def test_anti_loop_breaks_an_oscillation_that_plain_editing_rides_to_its_budget() -> None:
    decoder, state = block_state([1, 2], 2)  # block 1: positions 2..3, all masks
    forwards = run_block(decoder, state, oscillating)
    # Forwards of [M M] → [A A] → [B B] → [A A] (seen: position 0 redrawn to C) → [C B] →
    # [C A] → [C B] (seen: position 1 → C) → [C C], which writes nothing: closed.
    assert state.tokens[2:4] == [C, C]
    assert forwards == 8 and state.block == 2
    assert forwards < 2 + 16  # far from the budget JointThreshold would have spent


def deleting(tokens: list[int]) -> list[dict[int, float]]:
    """Masks become A; every token is confidently deleted (SPLIT second, A third)."""
    return [{A: 5.0} if t == M else {DEL: 5.0, SPLIT: 4.0, A: 3.0} for t in tokens]


def test_the_cleanup_round_writes_no_edit_token_and_its_block_is_forwarded_again() -> None:
    decoder, state = block_state([1, 2], 2, budget=2)
    forwards = run_block(decoder, state, deleting)
    # [M M] → [A A] → DELETE both: [M M] (introduced) → post-edit budget reached: cleanup
    # writes the clean argmax A → one more forward persists the K/V → closed.
    assert state.tokens[2:4] == [A, A]
    assert forwards == 4 and state.block == 2
    assert DEL not in state.tokens and SPLIT not in state.tokens


def test_the_prompt_tail_is_never_edited() -> None:
    def model(tokens: list[int]) -> list[dict[int, float]]:
        if tokens == [M, M]:
            return [{A: 5.0}, {B: 5.0}]
        if tokens == [A, B]:
            return [{DEL: 5.0}, {B: 5.0}]  # delete position 6: position 7 moves left
        return [{t: 5.0} if t != M else {C: 5.0} for t in tokens]

    decoder, state = block_state([21, 22, 23, 24, 25, 26], 4)  # block 1: 4..7, prompt 4, 5
    assert state.editable == [6, 7]
    run_block(decoder, state, model)
    assert state.tokens[:8] == [21, 22, 23, 24, 25, 26, B, C]


# ---- the engine against a no-cache re-statement ------------------------------------------------


def edit_happy(path: Path, loaded_ids: tuple[int, int], scale: float) -> None:
    """Scale the LM head rows of DELETE and SPLIT: a random model then proposes them often
    enough for the edits to fire (a trained one would where an edit helps)."""
    weights = load_file(str(path / "model.safetensors"))
    (head,) = [k for k in weights if k.endswith("lm_head.weight")]
    for token in loaded_ids:
        weights[head][token] *= scale
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module", params=[4, 32], ids=["block4", "block32"])
def llada22_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = Path(tmp_path_factory.mktemp(f"llada22-{request.param}"))
    path = write_tiny_llada2(root / "tiny-llada22", block_size=request.param, seed=3,
                             levenshtein=True)  # fmt: skip
    config = json.loads((path / "config.json").read_text())
    edit_happy(path, (config["delete_token_id"], config["split_token_id"]), 3.0)
    return path


@pytest.fixture(scope="module")
def reference_model(llada22_dir: Path) -> LoadedModel:
    return load_model(str(llada22_dir), device="cpu", dtype="float32")


@torch.no_grad()
def indel_loop(
    loaded: LoadedModel, prompt: list[int], params: DecodingParams
) -> tuple[list[int], list[int], int]:
    """(answer, forwards of each block, DELETE/SPLIT writes) of the no-cache loop."""
    model, mask, b = loaded.model, loaded.mask_id, loaded.block_size
    assert b is not None and loaded.edit_token_ids is not None
    delete, split = loaded.edit_token_ids
    tau, tau_edit = params.mask_threshold, params.edit_threshold or 0.0
    budget = params.max_post_edit_steps
    stops = (*loaded.stop_ids, *params.stop_token_ids)
    total = -(-(len(prompt) + params.gen_length) // b) * b
    x = prompt + [mask] * (total - len(prompt))
    forwards: list[int] = []
    edit_tokens = 0

    def answer() -> tuple[list[int], bool]:
        out = []
        for token in x[len(prompt) : len(prompt) + params.gen_length]:
            if token == mask:
                return out, False
            if token in stops:
                return out, True
            out.append(token)
        return out, True

    for k in range(len(prompt) // b, total // b):
        lo, hi = k * b, (k + 1) * b
        first = max(lo, len(prompt))
        n = hi - first
        original = [x[q] == mask for q in range(first, hi)]
        history: list[set[int]] = [set() for _ in range(n)]
        seen: set[tuple[int, ...]] = set()
        update = post = count = 0
        while True:
            pos = torch.arange(hi)
            allowed = (pos[None, :] // b) <= (pos[:, None] // b)  # block-causal
            hidden = model(torch.tensor([x[:hi]]), pos[None], allowed[None, None])
            z = model.lm_head(hidden[0, first:hi]).float()
            count += 1
            z[:, mask] = -float("inf")
            x0 = z.argmax(-1).tolist()
            p = torch.softmax(z, -1).max(-1).values.tolist()
            zc = z.clone()
            zc[:, [delete, split]] = -float("inf")
            xc = zc.argmax(-1).tolist()
            cur = x[first:hi]
            masks = [i for i in range(n) if cur[i] == mask]
            left = [i for i in masks if original[i]]
            update += 1
            post += 0 if left else 1
            final = (budget > 0 and post >= budget) or (budget == 0 and not left)
            final = final or update > b + budget
            m2t = masks
            if not final and left:
                need = 1 + len(masks) - len(left)
                above = [i for i in masks if p[i] > tau]
                ranked = sorted(masks, key=lambda i: (-p[i], i))
                m2t = above if len(above) >= need else ranked[:need]
                if budget == 0 and set(left) <= set(m2t):
                    final, m2t = True, masks
            t2t = [i for i in range(n) if cur[i] != mask and p[i] > tau_edit and x0[i] != cur[i]]
            write = {i: (xc if final else x0)[i] for i in set(m2t) | set(t2t)}
            changing = [i for i in write if write[i] != cur[i]]
            if tuple(cur) in seen and not final and changing:
                i = min(changing, key=lambda j: (p[j], j))
                row = z[i].clone()
                row[sorted(history[i] | {mask})] = -float("inf")
                write[i] = int(row.argmax())
            seen.add(tuple(cur))
            if not write:
                break
            new: list[int] = []
            flags: list[bool] = []
            for i in range(n):
                t = write.get(i, cur[i])
                if i in write:
                    history[i].add(t)
                if t == delete:
                    edit_tokens += 1
                elif t == split:
                    edit_tokens += 1
                    new += [mask, cur[i]]
                    flags += [False, original[i]]
                else:
                    new.append(t)
                    flags.append(original[i])
            new = (new + [mask] * n)[:n]
            original = (flags + [False] * n)[:n]
            x[first:hi] = new
            if final:
                count += new != cur  # one more forward writes the final tokens' K/V
                break
        forwards.append(count)
        tokens, ended = answer()
        if ended:
            return tokens, forwards, edit_tokens
    return answer()[0], forwards, edit_tokens


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_engine_equals_the_indel_loop(
    llada22_dir: Path, reference_model: LoadedModel, setting: str
) -> None:
    params = DecodingParams(gen_length=10, steps=64, **SETTINGS[setting])
    b = reference_model.block_size
    assert b is not None
    made = 0
    # Forward counts are compared with the prefix cache off (a prompt sharing another's whole
    # blocks skips its prefill); with it on (the default) the answers are the same.
    no_cache = EngineConfig(enable_prefix_caching=False)
    with (
        LLM(str(llada22_dir), device="cpu", dtype="float32", engine_config=no_cache) as llm,
        LLM(str(llada22_dir), device="cpu", dtype="float32") as cached,
    ):
        assert llm.engine.insert_delete
        for prompt in prompts(b):
            (got,) = llm.generate_ids([prompt], [params])
            want, forwards, edits = indel_loop(reference_model, prompt, params)
            made += edits
            assert got.text == reference_model.tokenizer.decode(want, skip_special_tokens=True)
            assert got.completion_tokens == len(want)
            prefill = 1 if len(prompt) >= b else 0
            assert got.nfe == prefill + sum(forwards)
            assert max(forwards) <= b + params.max_post_edit_steps + 2
            assert cached.generate_ids([prompt], [params])[0].text == got.text
    assert made > 0  # DELETE / SPLIT were written


def test_batched_rows_equal_each_alone(llada22_dir: Path, reference_model: LoadedModel) -> None:
    """Insert/delete rows beside JointThreshold-free rows (the routing blocks are per request)."""
    b = reference_model.block_size or 1
    settings = [
        DecodingParams(gen_length=10, steps=64, **SETTINGS["s-mode"]),
        DecodingParams(gen_length=9, steps=64, confidence_threshold=TAU_MASK),
        DecodingParams(gen_length=10, steps=64, **SETTINGS["budget-2"]),
        DecodingParams(gen_length=8, steps=64),
    ]
    batch = [prompts(b)[i % 4] for i in range(len(settings))]
    no_cache = EngineConfig(enable_prefix_caching=False)
    with LLM(str(llada22_dir), device="cpu", dtype="float32", engine_config=no_cache) as llm:
        together = llm.generate_ids(batch, settings)
        alone = [llm.generate_ids([p], [s])[0] for p, s in zip(batch, settings, strict=True)]
    assert [c.text for c in together] == [c.text for c in alone]
    assert [c.nfe for c in together] == [c.nfe for c in alone]


def test_closed_blocks_cache_a_fresh_encode_of_their_final_tokens(
    reference_model: LoadedModel,
) -> None:
    loaded = reference_model
    b = loaded.block_size
    assert b is not None
    decoder = BlockDiffusionDecoder(
        loaded.mask_id, [], b, editing=True, edit_tokens=loaded.edit_token_ids
    )
    runner = ModelRunner(loaded.model, torch.device("cpu"), kv_slots=512)
    pool = runner.pool
    assert pool is not None
    prompt = prompts(b)[1]
    params = DecodingParams(gen_length=3 * b, steps=64, **SETTINGS["budget-2"])
    state: BlockState = decoder.init_state(prompt, params, "cpu")
    state.kv = pool.reserve(decoder.kv_tokens(len(prompt), params))
    assert state.kv is not None
    checked = 0
    with torch.inference_mode():
        while not state.finished:
            kept, answered = state.kv.length, state.final_len
            logits = runner.run([decoder.prepare(state)])
            decoder.commit([state], decoder.sample([state], logits).tolist())
            if state.kv.length <= max(kept, len(prompt) // b * b):
                # No block closed: nothing of the open block reaches the answer (the stream).
                assert state.final_len == answered
                continue
            n = state.kv.length
            assert loaded.mask_id not in state.tokens[:n]
            assert not set(loaded.edit_token_ids or ()) & set(state.tokens[:n])
            slots = state.kv.slots(0, n)
            keys, values = pool.k[:, slots].clone(), pool.v[:, slots].clone()
            fresh = pool.reserve(n)
            assert fresh is not None
            row = RowSpec(state.tokens[:n], 0, [n - 1], AttentionKind.BLOCK_CAUSAL, kv=fresh,
                          block=b)  # fmt: skip
            runner.run([row])
            want = fresh.slots(0, n)
            assert (keys - pool.k[:, want]).abs().max() <= 1e-5
            assert (values - pool.v[:, want]).abs().max() <= 1e-5
            pool.free(fresh)
            checked += 1
    assert checked >= 2
    pool.free(state.kv)


# ---- what is refused -----------------------------------------------------------------------


def test_sampling_and_logprobs_are_refused_under_insert_delete(llada22_dir: Path) -> None:
    with LLM(str(llada22_dir), device="cpu", dtype="float32") as llm:
        hot = DecodingParams(gen_length=8, steps=8, edit_threshold=0.0, temperature=0.7)
        with pytest.raises(ValueError, match="greedy: temperature must be 0"):
            llm.generate_ids([[11, 12]], [hot])
        logprobs = DecodingParams(gen_length=8, steps=8, edit_threshold=0.0, logprobs=1)
        with pytest.raises(ValueError, match="logprobs are not recorded"):
            llm.generate_ids([[11, 12]], [logprobs])
        # Without editing the same request samples as on any LLaDA2 checkpoint.
        plain = DecodingParams(gen_length=8, steps=8, temperature=0.7, seed=1)
        assert llm.generate_ids([[11, 12]], [plain])[0].completion_tokens >= 0


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"delete_token_id": 5000}, "outside the vocabulary"),
        ({"split_token_id": "mask"}, "the mask id"),
        ({"split_token_id": "delete"}, "both"),
        ({"split_token_id": None}, "declares delete_token_id alone"),
        ({"block_size": None}, "expert_capacity .*without block_size"),
    ],
)
def test_bad_edit_tokens_are_refused_at_load(
    llada22_dir: Path, tmp_path: Path, change: dict, match: str
) -> None:
    path = Path(shutil.copytree(llada22_dir, tmp_path / "bad"))
    config = json.loads((path / "config.json").read_text())
    mask = load_model(str(llada22_dir), device="cpu", dtype="float32").mask_id
    for key, value in change.items():
        value = {"mask": mask, "delete": config["delete_token_id"]}.get(value, value)
        config[key] = value
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=match):
        load_model(str(path), device="cpu", dtype="float32")
