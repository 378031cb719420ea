"""LLaDA2 (``llada2_moe``) through the block-diffusion engine == the official loop without a cache.

The reference is the official ``generate()`` loop (reference ``block_diffusion.md`` §2.4), with
argmax at T = 0 as every engine does it: the canvas rounded up to whole blocks from position 0;
for each block from ``⌊P/B⌋`` on, full forwards over ``canvas[: end of block]`` with the
block-causal mask; each step commits the masked positions whose confidence is *strictly* above
the threshold when there are at least the step's quota of them, else the quota's most
confident (quota: the block's masks split evenly over ``min(steps, masks)`` steps; with no
threshold only the quota rule applies). The engine forwards the active block against its
exact cache (the finished block's write fused with the next block's first step); the two must
agree token for token, on the checkpoint's block (4 here, for many blocks) and the default 32.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dllm_serve.config import EngineConfig
from dllm_serve.decoding.commit_rules import uniform_schedule
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.llm import LLM
from dllm_serve.models.loader import LoadedModel, load_model
from dllm_serve_train.tiny_checkpoints import write_tiny_llada2

# The tiny random model is nearly uniform over its 768 tokens (top probabilities ≈ 0.0020 to
# 0.0024), so this threshold commits several positions in some steps and falls back to the
# quota in others; the tests check that both happen.
THRESHOLD = 0.002


@pytest.fixture(scope="module", params=[4, 32], ids=["block4", "block32"])
def llada2_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny LLaDA2 checkpoint (``make-tiny --family llada2``), block 4 or the default 32."""
    root = Path(tmp_path_factory.mktemp(f"llada2-{request.param}"))
    return write_tiny_llada2(root / "tiny-llada2", block_size=request.param, seed=3)


@pytest.fixture(scope="module")
def reference_model(llada2_dir: Path) -> LoadedModel:
    return load_model(str(llada2_dir), device="cpu", dtype="float32")


@torch.no_grad()
def reference(
    loaded: LoadedModel, prompt: list[int], params: DecodingParams
) -> tuple[list[int], list[int]]:
    """(answer tokens, tokens committed by each forward) of the no-cache official loop."""
    model, mask, b = loaded.model, loaded.mask_id, loaded.block_size
    assert b is not None
    stops = (*loaded.stop_ids, *params.stop_token_ids)
    total = -(-(len(prompt) + params.gen_length) // b) * b
    x = prompt + [mask] * (total - len(prompt))
    commits: list[int] = []

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
        masked = [p for p in range(lo, hi) if x[p] == mask]
        quotas = uniform_schedule(len(masked), max(1, min(params.steps, len(masked))))
        step = 0
        while masked:
            pos = torch.arange(hi)
            allowed = (pos[None, :] // b) <= (pos[:, None] // b)  # block-causal
            hidden = model(torch.tensor([x[:hi]]), pos[None], allowed[None, None])
            z = model.lm_head(hidden[0, masked]).double()
            z[:, mask] = -float("inf")
            x0 = z.argmax(-1)
            conf = torch.softmax(z, -1).max(-1).values
            order = sorted(range(len(masked)), key=lambda i: (-float(conf[i]), i))
            threshold = params.confidence_threshold
            above = [] if threshold is None else [i for i in order if conf[i] > threshold]
            chosen = above if len(above) >= quotas[step] else order[: quotas[step]]
            for i in chosen:
                x[masked[i]] = int(x0[i])
            commits.append(len(chosen))
            masked = [p for p in masked if x[p] == mask]
            step += 1
            tokens, ended = answer()
            if ended:
                return tokens, commits
    return answer()[0], commits


def prompts(b: int) -> list[list[int]]:
    """Prompt lengths ≡ 0, 1 and B-1 (mod B), and shorter than a block."""
    return [list(range(11, 11 + n)) for n in (2 * b, 2 * b + 1, 2 * b - 1, 2)]


SETTINGS = {
    "one-per-step": {"gen_length": 11, "steps": 64},  # steps ≥ masks: the official quota 1
    "two-steps": {"gen_length": 9, "steps": 2},  # quota masks/2 per step
    "threshold": {"gen_length": 10, "steps": 64, "confidence_threshold": THRESHOLD},
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_engine_equals_the_official_loop(
    llada2_dir: Path, reference_model: LoadedModel, setting: str
) -> None:
    params = DecodingParams(**SETTINGS[setting])
    b = reference_model.block_size
    assert b is not None
    commits: list[int] = []
    # Forward by forward as the official loop: no prefix cache (its prompts share prefixes).
    config = EngineConfig(enable_prefix_caching=False)
    with LLM(str(llada2_dir), device="cpu", dtype="float32", engine_config=config) as llm:
        assert llm.engine.decoding_mode == "block_diffusion"
        fed: list[int] = []
        real_run = llm.engine.runner.run

        def run(rows):  # type: ignore[no-untyped-def]
            fed.extend(len(row.tokens) for row in rows)
            return real_run(rows)

        llm.engine.runner.run = run  # type: ignore[method-assign]
        for prompt in prompts(b):
            fed.clear()
            (got,) = llm.generate_ids([prompt], [params])
            want, steps = reference(reference_model, prompt, params)
            commits += steps
            assert got.text == reference_model.tokenizer.decode(want, skip_special_tokens=True)
            assert got.completion_tokens == len(want)
            # A prefill of the prompt's whole blocks, then one forward per reference step of
            # the active block (B tokens), or of it and the block whose K/V it writes (2B).
            prefill = [len(prompt) // b * b] if len(prompt) >= b else []
            assert fed[: len(prefill)] == prefill
            assert set(fed[len(prefill) :]) <= {b, 2 * b}
            assert got.nfe == len(fed) == len(prefill) + len(steps)
    if setting == "threshold":  # the rule was exercised both ways
        assert max(commits) > 1 and min(commits) == 1


def test_role_end_and_eos_stop_the_answer(reference_model: LoadedModel, llada2_dir: Path) -> None:
    """Whatever token the answer would produce, as a stop it cuts the answer there; the
    model's own stops are <|endoftext|> and <|role_end|>."""
    tok = reference_model.tokenizer
    ends = {tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|role_end|>")}
    assert set(reference_model.stop_ids) == ends
    prompt = prompts(reference_model.block_size or 1)[1]
    free, _ = reference(reference_model, prompt, DecodingParams(gen_length=12, steps=64))
    stop = free[5]
    params = DecodingParams(gen_length=12, steps=64, stop_token_ids=(stop,))
    want, _ = reference(reference_model, prompt, params)
    assert want == free[: free.index(stop)]
    with LLM(str(llada2_dir), device="cpu", dtype="float32") as llm:
        (got,) = llm.generate_ids([prompt], [params])
    assert got.finish_reason == "stop" and got.completion_tokens == len(want)
    assert got.text == tok.decode(want, skip_special_tokens=True)


def test_batched_requests_equal_each_alone(llada2_dir: Path, reference_model: LoadedModel) -> None:
    settings = [DecodingParams(**SETTINGS[name]) for name in SETTINGS] * 2
    settings[4] = DecodingParams(gen_length=10, steps=64, temperature=0.9, seed=5)
    all_prompts = prompts(reference_model.block_size or 1)
    batch = [all_prompts[i % len(all_prompts)] for i in range(len(settings))]
    # Without the prefix cache: each request alone would hit the batch's cached prompts and
    # skip their prefill forwards (the same texts, fewer forwards).
    config = EngineConfig(enable_prefix_caching=False)
    with LLM(str(llada2_dir), device="cpu", dtype="float32", engine_config=config) as llm:
        together = llm.generate_ids(batch, settings)
        alone = [llm.generate_ids([p], [s])[0] for p, s in zip(batch, settings, strict=True)]
        assert llm.engine.kv_cache_bytes == 0
    assert [c.text for c in together] == [c.text for c in alone]
    assert [c.nfe for c in together] == [c.nfe for c in alone]
