"""Block diffusion (SDAR): family dispatch, and the cached engine == the no-cache official loop.

The reference below is written straight from SDAR's ``generate.py`` loop (argmax at T = 0, the
mask id excluded): the canvas rounded up to whole blocks from position 0, and for each block
from ``⌊P/B⌋`` on, full forwards over ``canvas[: end of block]`` with the block-causal mask,
committing at the block's masked positions — no KV cache at all. The engine forwards only the
active block against its exact cache, so the two must agree token for token.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dllm_serve.decoding.commit_rules import uniform_schedule
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.llm import LLM
from dllm_serve.models.families import SDAR, SDAR_BLOCK, family_for
from dllm_serve.models.loader import LoadedModel, load_model
from dllm_serve_train.tiny_checkpoints import write_tiny_sdar

B = 4
FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "idlm-8b" / "config.json"


def test_dispatch_reads_use_regular_causal() -> None:
    config = json.loads(FIXTURE.read_text())
    assert family_for(config) is SDAR  # I-DLM: SDARConfig's default, strictly causal
    assert family_for({**config, "use_regular_causal": True}) is SDAR
    assert family_for({**config, "use_regular_causal": False}) is SDAR_BLOCK
    assert SDAR_BLOCK.block_diffusion and not SDAR_BLOCK.logit_shift
    with pytest.raises(ValueError, match="block_size"):
        family_for({**config, "use_regular_causal": False, "block_size": 0})


@pytest.mark.parametrize("value", ["false", "true", 0, 1])
def test_use_regular_causal_must_be_a_boolean(value: object) -> None:
    # Found by QA: the string "false" is truthy, so it had loaded SDAR as I-DLM silently.
    config = json.loads(FIXTURE.read_text())
    qwen3 = {**config, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
    for form in (config, qwen3):  # I-DLM is published under both model types
        with pytest.raises(ValueError, match=f"use_regular_causal must be true .* got {value!r}"):
            family_for({**form, "use_regular_causal": value})


def test_block_causal_qwen3_names_its_conflict() -> None:
    # Found by QA: it was refused as a Qwen3 config "without mask_token_id", which it carries.
    config = {**json.loads(FIXTURE.read_text()), "model_type": "qwen3"}
    config["architectures"] = ["Qwen3ForCausalLM"]
    assert "mask_token_id" in config
    with pytest.raises(ValueError, match="model_type 'qwen3' with use_regular_causal: false"):
        family_for({**config, "use_regular_causal": False})


@pytest.fixture(scope="module")
def sdar_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny SDAR block-diffusion checkpoint (``make-tiny --family sdar``)."""
    return write_tiny_sdar(
        Path(tmp_path_factory.mktemp("sdar")) / "tiny-sdar", block_size=B, seed=3
    )


@pytest.fixture(scope="module")
def reference_model(sdar_dir: Path) -> LoadedModel:
    return load_model(str(sdar_dir), device="cpu", dtype="float32")


@torch.no_grad()
def reference(
    loaded: LoadedModel, prompt: list[int], params: DecodingParams
) -> tuple[list[int], int]:
    """(answer tokens, denoising forwards) of the no-cache official loop at T = 0."""
    model, mask = loaded.model, loaded.mask_id
    stops = (*loaded.stop_ids, *params.stop_token_ids)
    total = -(-(len(prompt) + params.gen_length) // B) * B
    x = prompt + [mask] * (total - len(prompt))
    nfe = 0

    def answer() -> tuple[list[int], bool]:
        """The contiguous committed answer within budget, cut at a stop; whether it ended."""
        out = []
        for token in x[len(prompt) : len(prompt) + params.gen_length]:
            if token == mask:
                return out, False
            if token in stops:
                return out, True
            out.append(token)
        return out, True

    for k in range(len(prompt) // B, total // B):
        lo, hi = k * B, (k + 1) * B
        masked = [p for p in range(lo, hi) if x[p] == mask]
        schedule = uniform_schedule(len(masked), max(1, min(params.steps, len(masked))))
        step = 0
        while masked:
            pos = torch.arange(hi)
            allowed = (pos[None, :] // B) <= (pos[:, None] // B)  # block-causal
            hidden = model(torch.tensor([x[:hi]]), pos[None], allowed[None, None])
            z = model.lm_head(hidden[0, masked]).double()
            z[:, mask] = -float("inf")
            nfe += 1
            x0 = z.argmax(-1)
            conf = torch.softmax(z, -1).max(-1).values
            order = sorted(range(len(masked)), key=lambda i: (-float(conf[i]), i))
            if params.confidence_threshold is None:
                chosen = order[: schedule[step]]
            else:
                chosen = [i for i in range(len(masked)) if conf[i] >= params.confidence_threshold]
                chosen = sorted(set(chosen) | {order[0]})
            for i in chosen:
                x[masked[i]] = int(x0[i])
            masked = [p for p in masked if x[p] == mask]
            step += 1
            tokens, ended = answer()
            if ended:
                return tokens, nfe
    return answer()[0], nfe


PROMPTS = [[11, 12, 13, 14, 15, 16, 17, 18], [11, 12, 13, 14, 15, 16, 17, 18, 19],
           [11, 12, 13, 14, 15, 16, 17], [21, 22]]  # fmt: skip  # ≡ 0, 1, B-1 mod B; < B
SETTINGS = [
    {"gen_length": 11, "steps": B},
    {"gen_length": 9, "steps": 2},
    {"gen_length": 10, "steps": B, "confidence_threshold": 0.05},
]


@pytest.mark.parametrize("fuse", [True, False], ids=["fused-write", "write-forward"])
@pytest.mark.parametrize("setting", SETTINGS, ids=["topk", "two-steps", "threshold"])
def test_cached_engine_equals_the_no_cache_loop(
    sdar_dir: Path, reference_model: LoadedModel, setting: dict, fuse: bool
) -> None:
    params = DecodingParams(**setting)
    with LLM(str(sdar_dir), device="cpu", dtype="float32") as llm:
        assert llm.engine.decoding_mode == "block_diffusion"
        llm.engine.algorithm.fuse_write = fuse  # type: ignore[union-attr]
        fed: list[int] = []
        real_run = llm.engine.runner.run

        def run(rows):  # type: ignore[no-untyped-def]
            fed.extend(len(row.tokens) for row in rows)
            return real_run(rows)

        llm.engine.runner.run = run  # type: ignore[method-assign]
        for prompt in PROMPTS:
            fed.clear()
            (got,) = llm.generate_ids([prompt], [params])
            want, denoise = reference(reference_model, prompt, params)
            assert llm.loaded.tokenizer.decode(want, skip_special_tokens=True) == got.text
            assert got.completion_tokens == len(want)
            # The exact cache: a prefill of the prompt's whole blocks, then only the active
            # block per forward (B tokens) — with the finished block before it when its write
            # is fused (2B), else one write forward of B tokens per finished block.
            prefill = [len(prompt) // B * B] if len(prompt) >= B else []
            assert fed[: len(prefill)] == prefill
            assert got.nfe == len(fed)
            if fuse:
                assert set(fed[len(prefill) :]) <= {B, 2 * B}
                assert len(fed) == len(prefill) + denoise  # no forward spent on writes
            else:
                assert set(fed[len(prefill) :]) == {B}
                writes = len(fed) - len(prefill) - denoise
                assert 0 <= writes <= -(-(len(prompt) + params.gen_length) // B)


def test_a_stop_id_ends_the_answer_exactly(sdar_dir: Path, reference_model: LoadedModel) -> None:
    free = DecodingParams(gen_length=12, steps=B)
    prompt = PROMPTS[1]
    tokens, _ = reference(reference_model, prompt, free)
    stop = tokens[5]  # a token the answer produces: as a stop id it cuts the answer there
    params = DecodingParams(gen_length=12, steps=B, stop_token_ids=(stop,))
    want, _ = reference(reference_model, prompt, params)
    assert want == tokens[: tokens.index(stop)]
    with LLM(str(sdar_dir), device="cpu", dtype="float32") as llm:
        (got,) = llm.generate_ids([prompt], [params])
    assert got.finish_reason == "stop" and got.completion_tokens == len(want)
    assert got.text == reference_model.tokenizer.decode(want, skip_special_tokens=True)


def test_batched_requests_equal_each_alone(sdar_dir: Path) -> None:
    settings = [DecodingParams(**SETTINGS[i % 3]) for i in range(8)]
    settings[3] = DecodingParams(gen_length=10, steps=B, temperature=0.9, seed=5)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
    with LLM(str(sdar_dir), device="cpu", dtype="float32") as llm:
        together = llm.generate_ids(prompts, settings)
        alone = [llm.generate_ids([p], [s])[0] for p, s in zip(prompts, settings, strict=True)]
        assert llm.engine.kv_cache_bytes == 0  # every span back in the pool
    assert [c.text for c in together] == [c.text for c in alone]
    assert [c.nfe for c in together] == [c.nfe for c in alone]


def test_another_block_length_is_a_400_through_the_server(sdar_dir: Path) -> None:
    from fastapi.testclient import TestClient

    from dllm_serve.api.app import build_app
    from dllm_serve.config import ServerConfig
    from dllm_serve.engine.engine import AsyncEngine

    engine = AsyncEngine(load_model(str(sdar_dir), device="cpu", dtype="float32"))
    with TestClient(build_app(engine, ServerConfig())) as client:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        bad = client.post("/v1/chat/completions", json={**body, "block_length": 8})
        assert bad.status_code == 400
        error = bad.json()["error"]
        assert error["param"] == "block_length" and error["code"] == "not_applicable"
        assert "must be 4" in error["message"]
        good = client.post("/v1/chat/completions", json={**body, "block_length": 4})
        assert good.status_code == 200, good.text
        usage = good.json()["usage"]
        assert usage["completion_tokens"] <= 8 and usage["diffusion"]["nfe"] >= 2
