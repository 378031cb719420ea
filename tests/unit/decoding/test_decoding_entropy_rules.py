"""The entropy commit rules: the EB-sampler (``entropy_bound``) and the entropy threshold.

Each batched rule equals a one-row re-statement on random ragged batches; through the engine a
block model's answers equal a no-cache loop that applies the re-statement, and batched rows
(mixed with every other rule) equal the same rows alone, on canvas and block models.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dllm_serve.decoding.commit_rules import (
    entropy_bound_commit_rows,
    entropy_of_score,
    entropy_threshold_commit_rows,
)
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.llm import LLM
from dllm_serve.models.hub import EMBEDDED_MODELS
from dllm_serve.models.loader import LoadedModel, load_model
from dllm_serve_train.tiny_checkpoints import write_tiny_llada2

pytestmark = pytest.mark.usefixtures("one_thread")

# ---- one row ---------------------------------------------------------------------------------


def eb_one_row(entropies: list[float], bound: float) -> set[int]:
    """The EB-sampler for one row: ascending entropies (lowest position first among equals);
    the first always, each next one while the entropies taken before it sum to ≤ γ."""
    order = sorted(range(len(entropies)), key=lambda i: (entropies[i], i))
    taken: set[int] = set()
    total = 0.0
    for rank, i in enumerate(order):
        if rank > 0 and total > bound:
            break
        taken.add(i)
        total += entropies[i]
    return taken


def threshold_one_row(entropies: list[float], threshold: float) -> set[int]:
    lowest = min(range(len(entropies)), key=lambda i: (entropies[i], i))
    return {i for i, h in enumerate(entropies) if h < threshold} | {lowest}


def batch_of_rows(seed: int) -> tuple[torch.Tensor, list[int]]:
    """Random entropies ``[R, W]`` in float64 (many ties), ragged rows padded with +inf."""
    g = torch.Generator().manual_seed(seed)
    rows, width = 12, 16
    h = torch.randint(0, 12, (rows, width), generator=g).double() / 8
    counts = torch.randint(1, width + 1, (rows,), generator=g).tolist()
    for r, n in enumerate(counts):
        h[r, n:] = float("inf")
    return h, counts


@pytest.mark.parametrize("seed", range(20))
def test_batched_rules_equal_one_row(seed: int) -> None:
    h, counts = batch_of_rows(seed)
    g = torch.Generator().manual_seed(1000 + seed)
    bounds = (torch.rand(h.shape[0], generator=g, dtype=torch.float64) * 3).tolist()
    taus = (torch.rand(h.shape[0], generator=g, dtype=torch.float64) * 1.5).tolist()
    eb = entropy_bound_commit_rows(h, torch.tensor(bounds, dtype=torch.float64))
    et = entropy_threshold_commit_rows(h, torch.tensor(taus, dtype=torch.float64))
    for r, n in enumerate(counts):
        row = h[r, :n].tolist()
        assert set(torch.nonzero(eb[r, :n]).flatten().tolist()) == eb_one_row(row, bounds[r])
        assert set(torch.nonzero(et[r, :n]).flatten().tolist()) == threshold_one_row(row, taus[r])


def test_scripted_cases() -> None:
    h = torch.tensor([[0.3, 0.1, 0.2, 2.0]], dtype=torch.float64)
    # γ = 0: the lowest only; γ 0.1: the two lowest (0.1 ≤ 0.1 before the second);
    # γ 0.35: 0.1 + 0.2 = 0.3 ≤ 0.35 before the third, 0.6 > 0.35 before the fourth.
    for bound, want in ((0.0, [1]), (0.1, [1, 2]), (0.35, [0, 1, 2]), (1.0, [0, 1, 2, 3])):
        got = entropy_bound_commit_rows(h, torch.tensor([bound], dtype=torch.float64))
        assert torch.nonzero(got[0]).flatten().tolist() == want
    # Below the threshold strictly; the lowest always.
    for tau in (0.2, 0.01):
        got = entropy_threshold_commit_rows(h, torch.tensor([tau], dtype=torch.float64))
        assert got[0].tolist() == [False, True, False, False]


def test_entropies_come_back_from_entropy_inverse_scores() -> None:
    h = torch.tensor([[0.0, 0.5, 6.6, 11.0]])
    score = torch.exp(-h)
    score[0, 3] = float("-inf")  # padding
    back = entropy_of_score(score)
    assert torch.allclose(back[0, :3], h[0, :3], atol=1e-6)
    assert math.isinf(back[0, 3])


# ---- through the engine ----------------------------------------------------------------------

# The tiny models are nearly uniform over 768 tokens: every entropy is about 6.629-6.631 nats,
# so γ = 7 commits two positions per step, and a threshold of 6.630 splits the positions.
BOUND, THRESHOLD = 7.0, 6.630

Chooser = Callable[[list[float]], set[int]]


@torch.no_grad()
def block_loop(
    loaded: LoadedModel, prompt: list[int], gen_length: int, choose: Chooser
) -> tuple[list[int], list[int]]:
    """(answer, commits per forward) of the no-cache block-diffusion loop under ``choose``
    (a set of indices into the block's masked positions, from their entropies)."""
    model, mask, b = loaded.model, loaded.mask_id, loaded.block_size
    assert b is not None
    total = -(-(len(prompt) + gen_length) // b) * b
    x = prompt + [mask] * (total - len(prompt))
    commits: list[int] = []

    def answer() -> tuple[list[int], bool]:
        out = []
        for token in x[len(prompt) : len(prompt) + gen_length]:
            if token == mask:
                return out, False
            if token in loaded.stop_ids:
                return out, True
            out.append(token)
        return out, True

    for k in range(len(prompt) // b, total // b):
        lo, hi = k * b, (k + 1) * b
        masked = [p for p in range(lo, hi) if x[p] == mask]
        while masked:
            pos = torch.arange(hi)
            allowed = (pos[None, :] // b) <= (pos[:, None] // b)
            hidden = model(torch.tensor([x[:hi]]), pos[None], allowed[None, None])
            z = model.lm_head(hidden[0, masked]).double()
            z[:, mask] = -float("inf")
            p = torch.softmax(z, -1)
            entropies = (-torch.special.xlogy(p, p).sum(-1)).tolist()
            chosen = choose(entropies)
            for i in chosen:
                x[masked[i]] = int(z[i].argmax())
            commits.append(len(chosen))
            masked = [q for q in masked if x[q] == mask]
            tokens, ended = answer()
            if ended:
                return tokens, commits
    return answer()[0], commits


@pytest.fixture(scope="module")
def llada2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LoadedModel]:
    root = Path(tmp_path_factory.mktemp("entropy-llada2"))
    path = write_tiny_llada2(root / "tiny-llada2", block_size=4, seed=3)
    return path, load_model(str(path), device="cpu", dtype="float32")


RULES: dict[str, tuple[dict[str, float], Chooser]] = {
    "entropy_bound": ({"entropy_bound": BOUND}, lambda h: eb_one_row(h, BOUND)),
    "entropy_bound_0": ({"entropy_bound": 0.0}, lambda h: eb_one_row(h, 0.0)),
    "entropy_threshold": ({"entropy_threshold": THRESHOLD},
                          lambda h: threshold_one_row(h, THRESHOLD)),
}  # fmt: skip


@pytest.mark.parametrize("rule", list(RULES))
def test_block_engine_equals_the_one_row_loop(llada2: tuple[Path, LoadedModel], rule: str) -> None:
    path, loaded = llada2
    fields, choose = RULES[rule]
    params = DecodingParams(gen_length=10, steps=64, **fields)
    commits: list[int] = []
    with LLM(str(path), device="cpu", dtype="float32") as llm:
        for n in (8, 9, 7, 2):
            prompt = list(range(11, 11 + n))
            (got,) = llm.generate_ids([prompt], [params])
            want, steps = block_loop(loaded, prompt, params.gen_length, choose)
            commits += steps
            assert got.text == loaded.tokenizer.decode(want, skip_special_tokens=True)
            assert got.nfe == (1 if n >= 4 else 0) + len(steps)
    if rule == "entropy_bound":
        assert set(commits) >= {2}  # more than one per step
    elif rule == "entropy_bound_0":
        assert set(commits) == {1}
    else:
        assert max(commits) > 1 and min(commits) == 1  # both sides of the threshold


@pytest.mark.parametrize("model", ["demo-llada", "demo-trimode"])
def test_batched_rows_equal_each_alone(model: str) -> None:
    """Canvas denoising (demo-llada) and block diffusion (demo-trimode's diffusion mode) on
    the shipped demos: trained models, whose entropies differ by more than a batched
    forward's rounding moves them (a tiny random model's all lie within 0.002 nats, so which
    is lowest can depend on the batch's float rounding)."""
    mode = "diffusion" if model == "demo-trimode" else None
    every_rule = [
        DecodingParams(gen_length=8, steps=8, entropy_bound=1.0),
        DecodingParams(gen_length=8, steps=8, entropy_threshold=0.5),
        DecodingParams(gen_length=8, steps=8),
        DecodingParams(gen_length=8, steps=8, confidence_threshold=0.9),
        DecodingParams(gen_length=8, steps=8, entropy_bound=0.5, temperature=0.8, seed=7),
        DecodingParams(gen_length=8, steps=8, use_local_leap=True),
    ]
    every_rule = [replace(p, decoding_mode=mode) for p in every_rule]
    with LLM(EMBEDDED_MODELS[model], device="cpu", dtype="float32") as llm:
        tok = llm.loaded.tokenizer
        chats = [[{"role": "user", "content": f"What is {i} + {3 * i}?"}] for i in range(6)]
        texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
                 for c in chats]  # fmt: skip
        prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
        together = llm.generate_ids(prompts, every_rule)
        alone = [llm.generate_ids([p], [s])[0] for p, s in zip(prompts, every_rule, strict=True)]
    assert [c.text for c in together] == [c.text for c in alone]
    assert [c.nfe for c in together] == [c.nfe for c in alone]
    assert together[0].nfe < 8 and together[1].nfe < 8  # several commits in some steps


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"entropy_bound": -0.1}, "entropy_bound must be in"),
        ({"entropy_threshold": 0.0}, "entropy_threshold must be in"),
        ({"entropy_bound": 0.1, "entropy_threshold": 1.0}, "entropy_bound and entropy_threshold"),
        ({"entropy_bound": 0.1, "confidence_threshold": 0.9}, "confidence_threshold"),
        ({"entropy_threshold": 0.5, "block_schedule": "cosine"}, "block_schedule applies"),
    ],
)
def test_params_refuse_contradictions(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DecodingParams(gen_length=8, steps=8, **fields)  # type: ignore[arg-type]
