"""LLaDA-MoE through the engine == LLaDA's reference loops, token for token, on a tiny checkpoint.

LLaDA-MoE decodes exactly as LLaDA-8B (full bidirectional canvas, no logit shift), so the
references are LLaDA's ``generate()`` at T = 0 (low-confidence remasking, the block's quota per
step) and Fast-dLLM's threshold loop with LocalLeap's variant, written straight from their
pseudocode as in ``test_decoding_parity.py`` — with the real network instead of a mock: each
step is a full padded forward of our model over the whole canvas (that forward equals the
checkpoint's own modeling code, ``tests/unit/models/test_models_lladamoe.py``). The engine runs
its flat batches with fused projections, in batches, with and without the prefix cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dllm_serve.config import EngineConfig
from dllm_serve.decoding.commit_rules import block_schedule
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.llm import LLM, Completion
from dllm_serve.models.families import LLADAMOE
from dllm_serve.models.loader import LoadedModel, load_model
from dllm_serve_train.tiny_checkpoints import write_tiny_lladamoe

pytestmark = pytest.mark.usefixtures("one_thread")

# The tiny random model is nearly uniform over its 768 tokens (top probabilities around 0.002),
# so these thresholds commit several positions in some steps and only the best one in others.
THRESHOLD = 0.0021
SETTINGS = {
    "uniform": {"gen_length": 16, "block_length": 8, "steps": 16},  # one token per step
    "two-per-step": {"gen_length": 16, "steps": 8},
    "front-loaded": {"gen_length": 12, "block_length": 6, "steps": 6,
                     "block_schedule": "front_loaded"},
    "cosine": {"gen_length": 12, "steps": 5, "block_schedule": "cosine"},
    "threshold": {"gen_length": 12, "block_length": 6, "steps": 4,
                  "confidence_threshold": THRESHOLD},
    "local-leap": {"gen_length": 12, "steps": 2, "block_length": 6, "use_local_leap": True,
                   "local_leap_anchor_threshold": THRESHOLD,
                   "local_leap_neighbor_threshold": 0.0019, "local_leap_radius": 2},
}  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every option of the format at once: a dense layer, a shared expert, partial RoPE, GQA."""
    root = Path(tmp_path_factory.mktemp("lladamoe"))
    return write_tiny_lladamoe(
        root / "tiny-lladamoe", seed=4, n_layers=3, dense_layers=1, shared_expert_hidden_size=24,
        rotary_dim=8, n_kv_heads=2,
    )  # fmt: skip


@pytest.fixture(scope="module")
def loaded(checkpoint: Path) -> LoadedModel:
    model = load_model(str(checkpoint), device="cpu", dtype="float32")
    assert model.family is LLADAMOE
    return model


@pytest.fixture(scope="module")
def llm(checkpoint: Path) -> Iterator[LLM]:
    with LLM(str(checkpoint), device="cpu", dtype="float32") as engine:
        assert engine.engine.decoding_mode == "diffusion"
        yield engine


def prompts(loaded: LoadedModel) -> list[list[int]]:
    chats = ["What is two plus two?", "hello", "Tell me a joke about the sea, please."]
    return [loaded.chat_prompt_ids([{"role": "user", "content": c}]) for c in chats]


@torch.no_grad()
def reference(loaded: LoadedModel, prompt: list[int], params: DecodingParams) -> list[int]:
    """The answer of LLaDA's loop at T = 0 without any cache: every step one full forward over
    the canvas; the mask id never proposed (the engine's and dInfer's guard); the answer cut
    at the first stop id."""
    model, mask = loaded.model, loaded.mask_id
    x = torch.tensor(prompt + [mask] * params.gen_length)
    positions = torch.arange(len(x))[None]
    steps_per_block = params.steps // params.num_blocks

    def propose() -> tuple[torch.Tensor, torch.Tensor]:
        z = model.lm_head(model(x[None], positions))[0].double()
        z[:, mask] = -float("inf")
        x0 = z.argmax(-1)
        return x0, torch.softmax(z, -1).gather(-1, x0[:, None]).squeeze(-1)

    for k in range(params.num_blocks):
        lo = len(prompt) + k * params.block_length
        hi = lo + params.block_length
        if params.mode == "topk":
            quota = block_schedule(params.block_schedule, params.block_length, steps_per_block)
            for n in quota:
                x0, c = propose()
                c[hi:] = -float("inf")
                c = torch.where(x == mask, c, torch.tensor(-float("inf"), dtype=c.dtype))
                idx = torch.topk(c, k=n).indices
                x[idx] = x0[idx]
            continue
        while bool((x[lo:hi] == mask).any()):
            x0, c = propose()
            masked = [p for p in range(lo, hi) if x[p] == mask]
            order = sorted(masked, key=lambda p: (-float(c[p]), p))
            kappa = params.confidence_threshold or params.local_leap_anchor_threshold
            per_position = {p: kappa for p in masked}
            if params.use_local_leap:
                radius = params.local_leap_radius
                for anchor in [p for p in masked if c[p] >= kappa]:
                    for p in masked:
                        if abs(p - anchor) <= radius:
                            per_position[p] = params.local_leap_neighbor_threshold
            keep = [order[0]] + [p for p in order[1:] if c[p] >= per_position[p]]
            x[keep] = x0[keep]
    answer = x[len(prompt) :].tolist()
    stops = {*loaded.stop_ids, *params.stop_token_ids}
    cut = next((i for i, t in enumerate(answer) if t in stops), len(answer))
    return answer[:cut]


def assert_same(loaded: LoadedModel, got: Completion, want: list[int]) -> None:
    assert got.completion_tokens == len(want)
    assert got.text == loaded.decode(want)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_engine_equals_the_reference_loop(loaded: LoadedModel, llm: LLM, setting: str) -> None:
    params = DecodingParams(**SETTINGS[setting])
    nfes = []
    for prompt in prompts(loaded):
        (got,) = llm.generate_ids([prompt], [params])
        assert_same(loaded, got, reference(loaded, prompt, params))
        nfes.append(got.nfe)
    if params.mode != "topk":  # the rules were exercised: some steps committed several tokens
        assert min(nfes) < params.gen_length


def test_a_stop_token_cuts_the_answer(loaded: LoadedModel, llm: LLM) -> None:
    prompt = prompts(loaded)[0]
    free = reference(loaded, prompt, DecodingParams(gen_length=12, steps=12))
    params = DecodingParams(gen_length=12, steps=12, stop_token_ids=(free[5],))
    want = reference(loaded, prompt, params)
    assert want == free[: free.index(free[5])]
    (got,) = llm.generate_ids([prompt], [params])
    assert got.finish_reason == "stop"
    assert_same(loaded, got, want)


def test_batched_mixed_requests_equal_each_alone(loaded: LoadedModel, llm: LLM) -> None:
    settings = [DecodingParams(**s) for s in SETTINGS.values()]
    settings.append(DecodingParams(gen_length=10, steps=10, temperature=0.9, seed=5))
    all_prompts = prompts(loaded)
    batch = [all_prompts[i % len(all_prompts)] for i in range(len(settings))]
    together = llm.generate_ids(batch, settings)
    alone = [llm.generate_ids([p], [s])[0] for p, s in zip(batch, settings, strict=True)]
    assert [(c.text, c.completion_tokens, c.nfe) for c in together] == [
        (c.text, c.completion_tokens, c.nfe) for c in alone
    ]


def test_prefix_cache(checkpoint: Path, loaded: LoadedModel) -> None:
    """``--kv-cache prefix`` applies to LLaDA-MoE as to LLaDA: with one step per block every
    step refreshes the cache from a full forward, so the answer is the reference's; with
    more, rows batched together equal each alone."""
    config = EngineConfig(kv_cache="prefix", max_waiting_requests=64)
    ids = prompts(loaded)
    refresh_only = DecodingParams(gen_length=12, block_length=3, steps=4)
    cached = [
        DecodingParams(gen_length=12, block_length=4, steps=12),
        DecodingParams(gen_length=12, block_length=6, steps=4, confidence_threshold=THRESHOLD),
        refresh_only,
    ]
    with LLM(str(checkpoint), device="cpu", dtype="float32", engine_config=config) as llm:
        (got,) = llm.generate_ids([ids[1]], [refresh_only])
        assert_same(loaded, got, reference(loaded, ids[1], refresh_only))
        together = llm.generate_ids(ids, cached)
        alone = [llm.generate_ids([p], [s])[0] for p, s in zip(ids, cached, strict=True)]
        assert llm.engine.kv_cache_bytes == 0
    assert [c.text for c in together] == [c.text for c in alone]
