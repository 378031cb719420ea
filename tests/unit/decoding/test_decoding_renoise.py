"""DiffusionGemma's entropy-bounded renoise sampler (``decoding/renoise.py``): the rule's
pieces against one-row restatements, whole answers against transformers 5.25's ``generate``
(token for token, same generator stream), batched == solo, seeds."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from trimode_support import admit, drive

from dllm_serve.decoding.params import DecodingParams
from dllm_serve.decoding.registry import renoise_decoder
from dllm_serve.decoding.renoise import (
    RenoiseSettings,
    entropy_bound_accept,
    renoise_settings,
    schedule_temperature,
    token_entropy,
)
from dllm_serve.engine.model_runner import ModelRunner
from dllm_serve.models.loader import LoadedModel, load_model
from dllm_serve_train.tiny_checkpoints import write_tiny_diffusion_gemma

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DiffusionGemmaForBlockDiffusion"):  # pragma: no cover
    if os.environ.get("DLLM_REQUIRE_TRANSFORMERS_REFERENCE"):  # CI: the reference must run
        raise RuntimeError("transformers >= 5.25 (DiffusionGemma's reference) is not installed")
    pytest.skip("transformers >= 5.25 (DiffusionGemma) is needed", allow_module_level=True)

CANVAS = 32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = Path(tmp_path_factory.mktemp("dg")) / "tiny-dg"
    return write_tiny_diffusion_gemma(out, canvas_length=CANVAS)


@pytest.fixture(scope="module")
def loaded(tiny: Path) -> LoadedModel:
    return load_model(str(tiny), dtype="float32")


@pytest.fixture
def runner(loaded: LoadedModel) -> ModelRunner:
    return ModelRunner(loaded.model, torch.device("cpu"), kv_slots=8192)


def prompt_of(loaded: LoadedModel, text: str) -> list[int]:
    return loaded.chat_prompt_ids([{"role": "user", "content": text}])


def run(
    runner: ModelRunner, loaded: LoadedModel, prompts: list[list[int]], params: list[DecodingParams]
) -> list[tuple[list[int], str | None]]:
    decoder = renoise_decoder(loaded)
    states = [admit(runner, decoder, p, q) for p, q in zip(prompts, params, strict=True)]
    drive(runner, decoder, states)
    for s in states:
        runner.pool.free(s.kv)
    return [(s.answer, s.finish_reason) for s in states]


# ---- the rule's pieces -------------------------------------------------------------------------


def test_temperature_schedule_runs_from_t_max_towards_t_min() -> None:
    s = RenoiseSettings()
    assert schedule_temperature(s, 48, 48) == pytest.approx(0.8)
    assert schedule_temperature(s, 1, 48) == pytest.approx(0.4 + 0.4 / 48)
    assert schedule_temperature(s, 8, 16) == pytest.approx(0.6)


def test_entropy_matches_categorical() -> None:
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(0)) * 4
    want = torch.distributions.Categorical(logits=logits).entropy()
    assert torch.equal(token_entropy(logits), want)


def test_entropy_bound_acceptance_restated() -> None:
    """Position k (by ascending entropy) is accepted iff the entropies below it sum to at
    most the bound; the lowest one always."""
    gen = torch.Generator().manual_seed(1)
    for bound in (0.05, 0.1, 0.5, 3.0):
        entropy = torch.rand(3, 20, generator=gen)
        got = entropy_bound_accept(entropy, bound)
        for r in range(3):
            values = entropy[r].tolist()
            order = sorted(range(20), key=lambda i: values[i])
            want, below = [False] * 20, 0.0
            for i in order:
                want[i] = below <= bound + 1e-7
                below += values[i]
            assert got[r].tolist() == want
            assert got[r, order[0]]


def test_settings_come_from_generation_config() -> None:
    s = renoise_settings(
        {"max_denoising_steps": 12, "t_max": 0.9, "t_min": 0.3, "confidence_threshold": 0.0,
         "stability_threshold": 2, "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig",
                                                      "entropy_bound": 0.25}}
    )  # fmt: skip
    assert s == RenoiseSettings(12, 0.25, 0.9, 0.3, 0.0, 2)
    assert renoise_settings({}) == RenoiseSettings()  # transformers' defaults: the released ones
    with pytest.raises(ValueError, match="entropy-bound"):
        renoise_settings({"sampler_config": {"_cls_name": "DiscreteDDIMSamplerConfig"}})


# ---- whole answers -------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 3])
def test_answers_equal_transformers_generate(
    tiny: Path, loaded: LoadedModel, runner: ModelRunner, seed: int
) -> None:
    """With the initial canvas and the renoise draws from one generator stream (ours per
    request, transformers' the global one after ``manual_seed``), the answer is token for token
    transformers' ``generate`` cut before the first EOS id: several canvases (seed 0 runs into
    the limit after three) or an EOS inside a canvas (seed 3)."""
    ref = transformers.DiffusionGemmaForBlockDiffusion.from_pretrained(tiny, dtype=torch.float32)
    prompt = prompt_of(loaded, f"Tell me a story {seed}")
    torch.manual_seed(seed)
    with torch.no_grad():
        out = ref.eval().generate(torch.tensor([prompt]), max_new_tokens=3 * CANVAS)
    sequence = out.sequences[0, len(prompt) :].tolist()
    cut = next((i for i, t in enumerate(sequence) if t in loaded.stop_ids), len(sequence))
    want = sequence[:cut]
    [(answer, reason)] = run(
        runner, loaded, [prompt], [DecodingParams(gen_length=3 * CANVAS, steps=48, seed=seed)]
    )
    assert answer == want
    if seed == 0:
        assert reason == "length" and len(answer) == 3 * CANVAS
    else:
        assert reason == "stop" and CANVAS < len(answer) < 2 * CANVAS


def test_batched_equals_solo_and_seeds_decide(loaded: LoadedModel, runner: ModelRunner) -> None:
    """Requests of different prompts, seeds, step counts and limits in shared forwards give
    what each gives alone; the same seed gives the same answer, another seed another one."""
    prompts = [prompt_of(loaded, t) for t in ("Hi", "What is two and two?", "Hi")]
    params = [
        DecodingParams(gen_length=40, steps=6, seed=7),
        DecodingParams(gen_length=2 * CANVAS, steps=9, seed=8, entropy_bound=0.5),
        DecodingParams(gen_length=40, steps=6, seed=7),
    ]
    together = run(runner, loaded, prompts, params)
    alone = [run(runner, loaded, [p], [q])[0] for p, q in zip(prompts, params, strict=True)]
    assert together == alone
    assert together[0] == together[2]  # same prompt, same seed
    other = run(runner, loaded, [prompts[0]], [DecodingParams(gen_length=40, steps=6, seed=70)])
    assert other[0][0] != together[0][0]
    assert len(together[0][0]) <= 40


def test_entropy_bound_and_steps_change_the_answer(
    loaded: LoadedModel, runner: ModelRunner
) -> None:
    """The request's entropy bound and step count are used (a larger bound accepts more)."""
    prompt = prompt_of(loaded, "Hi")
    base = run(runner, loaded, [prompt], [DecodingParams(gen_length=CANVAS, steps=8, seed=1)])
    wide = run(
        runner, loaded, [prompt],
        [DecodingParams(gen_length=CANVAS, steps=8, seed=1, entropy_bound=50.0)],
    )  # fmt: skip
    fewer = run(runner, loaded, [prompt], [DecodingParams(gen_length=CANVAS, steps=3, seed=1)])
    assert base != wide and base != fewer


def test_steps_above_the_checkpoint_max_are_refused(loaded: LoadedModel) -> None:
    decoder = renoise_decoder(loaded)
    with pytest.raises(ValueError, match="num_denoising_steps"):
        decoder.init_state([1, 2], DecodingParams(gen_length=8, steps=49), "cpu")
