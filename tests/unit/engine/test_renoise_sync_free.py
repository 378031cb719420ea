"""DiffusionGemma's renoise sampler reads nothing back: every ``sample`` call of a mixed
batch (a prefill, denoising rows with and without self-conditioning, a commit) runs under a
dispatch mode that fails any op reading a device value (``.item()``, ``nonzero``…). Its
draws use the requests' own generators, so it is checked on CPU, not replayed on meta."""

from __future__ import annotations

from pathlib import Path

import torch
from device_guard import DeviceOnly

from dllm_serve.decoding.params import DecodingParams
from dllm_serve.decoding.registry import renoise_decoder
from dllm_serve.decoding.renoise import COMMIT, DENOISE, PREFILL
from dllm_serve.engine.model_runner import ModelRunner
from dllm_serve.models.loader import load_model
from dllm_serve_train.tiny_checkpoints import write_tiny_diffusion_gemma

CPU = torch.device("cpu")


def test_every_sample_call_stays_on_the_device(tmp_path: Path) -> None:
    loaded = load_model(str(write_tiny_diffusion_gemma(tmp_path / "dg", canvas_length=16)))
    runner = ModelRunner(loaded.model, CPU, kv_slots=1024)
    decoder = renoise_decoder(loaded)
    params = [DecodingParams(gen_length=40, steps=3, seed=s, ignore_eos=True) for s in (1, 2)]
    states = []
    for i, p in enumerate(params):
        prompt = loaded.chat_prompt_ids([{"role": "user", "content": "hi" * (i + 1)}])
        state = decoder.init_state(prompt, p, CPU)
        state.kv = runner.pool.reserve(decoder.kv_tokens(len(prompt), p))
        states.append(state)
    phases: set[tuple[str, ...]] = set()
    with torch.inference_mode():
        # Start the second request two steps late: prefill and commit rows share steps with
        # denoising rows.
        for step in range(20):
            live = [s for s in states[: 1 if step < 2 else 2] if not s.finished]
            if not live:
                break
            logits = runner.run([decoder.prepare(s) for s in live])
            phases.add(tuple(s.phase for s in live))
            guard = DeviceOnly(CPU)
            with guard:
                out = decoder.sample(live, logits)
            assert guard.ops > 0
            decoder.commit(live, out.tolist())
    seen = {p for group in phases for p in group}
    assert {PREFILL, DENOISE, COMMIT} <= seen
    assert any(len(set(group)) > 1 for group in phases)  # mixed phases in one step
