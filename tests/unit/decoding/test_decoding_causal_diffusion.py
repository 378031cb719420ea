"""A tri-mode model's ``diffusion`` mode: block diffusion over a causal prefix with the causal
KV refresh, on a tiny Nemotron-format checkpoint.

- The served decoder (ModelRunner, KV pool, batched sampler) gives exactly the tokens of an
  independent re-statement of the reference loop that never caches anything (every step a full
  forward: causal over the prefix, bidirectional inside the block), in top-k and threshold mode.
- The refresh is necessary: K/V left by the diffusion view change the next causal logits; with
  the refresh the cached K/V equal a fresh causal prefill of ``prompt + answer``.
"""

from __future__ import annotations

import pytest
import torch
from trimode_support import CPU, admit, assert_cache_is_causal, causal_logits, drive

from dllm_serve.decoding.causal_blocks import DENOISE, REFRESH, CausalBlockDiffusionDecoder
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.decoding.protocol import AttentionKind, RowSpec
from dllm_serve.engine.model_runner import ModelRunner
from dllm_serve.models.loader import LoadedModel

PROMPTS = [[201, 305, 150, 420, 133], [512, 140]]
B = 8
pytestmark = pytest.mark.usefixtures("one_thread")


def _best(logits: torch.Tensor, mask_id: int) -> int:
    z = logits.double().clone()
    z[mask_id] = float("-inf")
    return int(z.argmax())


@torch.inference_mode()
def reference_generate(
    loaded: LoadedModel, prompt: list[int], gen_length: int, threshold: float | None
) -> list[int]:
    """Nemotron's ``generate(causal_context=True)`` restated without a cache (greedy, one
    token per step or the threshold rule; the mask id never proposed), answer cut at the
    first stop id."""
    model, mask = loaded.model, loaded.mask_id
    x = list(prompt)
    seed = _best(causal_logits(loaded, x)[-1], mask)
    for _ in range(-(-gen_length // B)):
        block = [seed] + [mask] * (B - 1)
        while mask in block:
            n = len(x) + B
            allowed = torch.ones(n, n, dtype=torch.bool).tril()
            allowed[len(x) :, len(x) :] = True  # bidirectional inside the block
            hidden = model(torch.tensor([x + block]), torch.arange(n)[None], allowed[None, None])
            z = model.lm_head(hidden[0, len(x) :]).float()  # the diffusion view: no shift
            z[:, mask] = float("-inf")
            probs = torch.softmax(z, dim=-1)
            x0 = z.argmax(-1)
            conf = probs.gather(-1, x0[:, None])[:, 0]
            masked = [i for i, t in enumerate(block) if t == mask]
            top = max(masked, key=lambda i: (float(conf[i]), -i))
            chosen = {top}
            if threshold is not None:
                chosen |= {i for i in masked if float(conf[i]) >= threshold}
            for i in chosen:
                block[i] = int(x0[i])
        x += block
        seed = _best(causal_logits(loaded, x)[-1], mask)
    answer = x[len(prompt) : len(prompt) + gen_length]
    cut = next((i for i, t in enumerate(answer) if t in loaded.stop_ids), len(answer))
    return answer[:cut]


@pytest.mark.parametrize("threshold", [None, 0.0015])
def test_served_diffusion_equals_the_uncached_reference(
    nemotron: LoadedModel, threshold: float | None
) -> None:
    decoder = CausalBlockDiffusionDecoder(nemotron.mask_id, nemotron.stop_ids, B)
    runner = ModelRunner(nemotron.model, CPU, kv_slots=256)
    params = DecodingParams(gen_length=20, steps=20, confidence_threshold=threshold)
    states = [admit(runner, decoder, p, params) for p in PROMPTS]  # batched rows
    drive(runner, decoder, states)
    for prompt, state in zip(PROMPTS, states, strict=True):
        assert state.answer_tokens() == reference_generate(nemotron, prompt, 20, threshold)
    if threshold is not None:  # some steps committed several tokens
        assert any(s.committed > s.nfe for s in states)


def test_refresh_leaves_exactly_the_causal_prefix(nemotron: LoadedModel) -> None:
    decoder = CausalBlockDiffusionDecoder(nemotron.mask_id, nemotron.stop_ids, B)
    runner = ModelRunner(nemotron.model, CPU, kv_slots=256)
    state = admit(runner, decoder, PROMPTS[0], DecodingParams(gen_length=24, steps=24))
    refreshed = 0

    def check(s, phase: str) -> None:
        nonlocal refreshed
        if phase in ("prefill", REFRESH) and not s.finished:
            assert s.phase == DENOISE and s.kv.length == s.active_block[0]
            assert_cache_is_causal(runner, s.kv, s.tokens[: s.kv.length])
            refreshed += phase == REFRESH

    drive(runner, decoder, [state], check)
    assert refreshed == 2  # three blocks of 8; the last one ends the request


@torch.no_grad()
def test_skipping_the_refresh_changes_the_next_logits(nemotron: LoadedModel) -> None:
    """Decode one block, then continue causally from (a) the refreshed prefix and (b) the K/V
    the diffusion view wrote for the same finished block (no refresh)."""
    decoder = CausalBlockDiffusionDecoder(nemotron.mask_id, nemotron.stop_ids, B)
    runner = ModelRunner(nemotron.model, CPU, kv_slots=256)
    state = admit(runner, decoder, PROMPTS[0], DecodingParams(gen_length=24, steps=24))
    drive(runner, decoder, [state], lambda s, _: setattr(s, "finished", s.phase == REFRESH))
    assert state.phase == REFRESH and state.kv is not None
    lo, hi = state.active_block
    block, nxt = state.tokens[lo:hi], [300, 301, 302]
    span = state.kv

    def next_logits() -> torch.Tensor:
        row = RowSpec(nxt, hi, [0, 1, 2], AttentionKind.CAUSAL, span)
        return runner.run([row])[0]

    # (b) no refresh: the finished block's K/V as the diffusion view computes them.
    runner.run([RowSpec(block, lo, [0], AttentionKind.BIDIRECTIONAL, span)])
    span.length = hi
    stale = next_logits()
    # (a) the refresh: one causal forward of the finished block.
    span.length = lo
    runner.run([RowSpec(block, lo, [B - 1], AttentionKind.CAUSAL, span)])
    span.length = hi
    refreshed = next_logits()
    want = causal_logits(nemotron, state.tokens[:hi] + nxt)[hi:]
    assert (refreshed - want).abs().max() <= 1e-5
    assert (stale - want).abs().max() > 100 * 1e-5
