"""DiffusionGemma's renoise sampler reads nothing back: every ``sample`` call of a mixed
batch (a prefill, denoising rows with and without self-conditioning, a commit) runs under a
dispatch mode that fails any op reading a device value (``.item()``, ``nonzero``…). Its
draws use the requests' own generators, so it is checked on CPU, not replayed on meta."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from device_guard import DeviceOnly

from dllm_serve.decoding.params import DecodingParams
from dllm_serve.decoding.registry import renoise_decoder
from dllm_serve.decoding.renoise import COMMIT, DENOISE, PREFILL
from dllm_serve.engine.model_runner import ModelRunner
from dllm_serve.models.kv_pool import PAGE_SIZE
from dllm_serve.models.loader import load_model
from dllm_serve_train.tiny_checkpoints import write_tiny_diffusion_gemma

CPU = torch.device("cpu")
META = torch.device("meta")


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
    # Start the second request two steps late: prefill and commit rows share steps with
    # denoising rows. The sampler runs under no_grad, not inference mode, in which the guard
    # would not see a scalar read (``.item()``, ``bool``).
    for step in range(20):
        live = [s for s in states[: 1 if step < 2 else 2] if not s.finished]
        if not live:
            break
        with torch.inference_mode():
            logits = runner.run([decoder.prepare(s) for s in live])
        phases.add(tuple(s.phase for s in live))
        guard = DeviceOnly(CPU)
        with torch.no_grad(), guard:
            out = decoder.sample(live, logits)
        assert guard.ops > 0
        decoder.commit(live, out.tolist())
    seen = {p for group in phases for p in group}
    assert {PREFILL, DENOISE, COMMIT} <= seen
    assert any(len(set(group)) > 1 for group in phases)  # mixed phases in one step


def test_forwards_neither_read_back_nor_copy_host_tensors(tmp_path: Path) -> None:
    """DiffusionGemma's forwards (prompt, canvas with and without self-conditioning, commit,
    mixed in one step), replayed on the meta device in bf16 under the guard: no value read
    back, no host tensor in device work, no copy inside the forward."""
    loaded = load_model(str(write_tiny_diffusion_gemma(tmp_path / "dg", canvas_length=16)))
    runner = ModelRunner(loaded.model, CPU, kv_slots=1024)
    decoder = renoise_decoder(loaded)
    params = DecodingParams(gen_length=40, steps=3, seed=1, ignore_eos=True)
    states = []
    for text in ("hi", "hello"):
        prompt = loaded.chat_prompt_ids([{"role": "user", "content": text}])
        state = decoder.init_state(prompt, params, CPU)
        state.kv = runner.pool.reserve(decoder.kv_tokens(len(prompt), params))
        states.append(state)
    recorded = []
    with torch.inference_mode():
        for step in range(12):
            live = [s for s in states[: 1 if step < 2 else 2] if not s.finished]
            rows = [decoder.prepare(s) for s in live]
            runner.build(rows)  # take the pages, as run() does
            recorded.append([copy.copy(r) for r in rows])
            decoder.commit(live, decoder.sample(live, runner.run(rows)).tolist())
    model = copy.deepcopy(loaded.model).to(META, torch.bfloat16)
    spans = [r.kv for rows in recorded for r in rows]
    slots = (1 + max(page for kv in spans for page in kv.pages)) * PAGE_SIZE
    meta = ModelRunner(model, META, kv_slots=slots)
    for sliding in (False, True):  # the frequencies go to the device once, before any step
        model._frequencies(sliding, META)
    mixed = conditioned = False
    with torch.no_grad():
        for rows in recorded:
            for r in rows:  # the self-conditioning signal lives on the device
                if r.model_input is not None:
                    r.model_input = torch.empty(r.model_input.shape, device=META)
                    conditioned = True
            mixed |= len({r.attention for r in rows}) > 1
            flat, _ = meta.build(rows)
            with DeviceOnly(META) as guard:  # (meta tensors hold no value to read anyway)
                logits = meta.forward(flat)
            assert logits.device == META and guard.ops > 0
    assert mixed and conditioned
