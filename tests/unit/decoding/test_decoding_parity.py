"""Token-for-token parity with LLaDA's generate() at T = 0 (algorithms.md §1.5, §7 item 7)."""

from __future__ import annotations

import pytest
import torch
from decoding_mock import EOS_ID, EOT_ID, MASK_ID, MockLM, run, truncate_at_stop

from dllm_serve.decoding.canvas import LLaDADenoiser
from dllm_serve.decoding.params import DecodingParams


def reference_generate(
    model: MockLM, prompt: list[int], steps: int, gen_length: int, block_length: int
) -> tuple[torch.Tensor, int]:
    """LLaDA generate() at temperature 0, low_confidence remasking, batch of one.

    Written straight from the pseudocode: full-canvas logits every step, confidence of the
    argmax, ``c[:, hi:] = -inf``, ``where(M, ...)``, ``topk``. Softmax in float64 (as LLaDA's
    app.py / Fast-dLLM; generate.py now uses the model dtype) so rankings are not float32 ties.
    Returns (canvas, NFE).
    """
    x = torch.full((1, len(prompt) + gen_length), MASK_ID, dtype=torch.long)
    x[0, : len(prompt)] = torch.tensor(prompt)
    assert gen_length % block_length == 0
    num_blocks = gen_length // block_length
    assert steps % num_blocks == 0
    steps_per_block = steps // num_blocks
    nfe = 0
    for k in range(num_blocks):
        lo = len(prompt) + k * block_length
        hi = lo + block_length
        n = int((x[0, lo:hi] == MASK_ID).sum())
        base, rem = divmod(n, steps_per_block)
        sched = [base + (i < rem) for i in range(steps_per_block)]
        for i in range(steps_per_block):
            masked = x == MASK_ID
            z = model(x[0]).unsqueeze(0)  # (1, L, V)
            nfe += 1
            x0 = z.argmax(-1)
            p = torch.softmax(z.to(torch.float64), -1)
            c = torch.gather(p, -1, x0.unsqueeze(-1)).squeeze(-1)
            c[:, hi:] = -float("inf")
            x0 = torch.where(masked, x0, x)
            c = torch.where(masked, c, torch.tensor(-float("inf"), dtype=torch.float64))
            _, idx = torch.topk(c[0], k=sched[i])
            x[0, idx] = x0[0, idx]
    return x[0], nfe


CONFIGS = [(16, 16, 16), (16, 8, 8), (32, 8, 16), (24, 4, 24), (16, 4, 4), (30, 10, 9)]


@pytest.mark.parametrize("model_seed", [0, 1])
@pytest.mark.parametrize(("gen", "block", "steps"), CONFIGS)
def test_parity_with_reference(gen: int, block: int, steps: int, model_seed: int) -> None:
    model = MockLM(seed=model_seed)
    prompt = [5, 17, 8, 30, 11, 1]
    ref, ref_nfe = reference_generate(model, prompt, steps, gen, block)
    params = DecodingParams(gen_length=gen, block_length=block, steps=steps, seed=123)
    denoiser = LLaDADenoiser(MASK_ID, ())
    state = denoiser.init_state(prompt, params, "cpu")
    run(denoiser, state, model)
    assert torch.equal(state.canvas, ref)
    assert state.nfe == ref_nfe == steps


def test_parity_with_zero_commit_steps() -> None:
    # steps_per_block (4) > block_length (2): the reference spends 16 NFE; the denoiser gives
    # the same tokens and skips every block's trailing no-op steps.
    model = MockLM(seed=3)
    prompt = [4, 4, 9]
    ref, ref_nfe = reference_generate(model, prompt, steps=16, gen_length=8, block_length=2)
    params = DecodingParams(gen_length=8, block_length=2, steps=16)
    denoiser = LLaDADenoiser(MASK_ID, ())
    state = denoiser.init_state(prompt, params, "cpu")
    run(denoiser, state, model)
    assert torch.equal(state.canvas, ref)
    assert (ref_nfe, state.nfe) == (16, 8)


def test_parity_of_answer_with_early_stop() -> None:
    model = MockLM(seed=2)
    model.bias[3 + 5, EOS_ID] = 30.0
    prompt = [12, 13, 14]
    ref, _ = reference_generate(model, prompt, steps=16, gen_length=32, block_length=8)
    params = DecodingParams(gen_length=32, block_length=8, steps=16)
    denoiser = LLaDADenoiser(MASK_ID, (EOS_ID, EOT_ID))
    state = denoiser.init_state(prompt, params, "cpu")
    run(denoiser, state, model)
    assert state.finish_reason == "stop" and state.nfe < 16
    assert state.answer_tokens() == truncate_at_stop(ref[3:].tolist(), (EOS_ID, EOT_ID))


def reference_threshold_generate(
    model: MockLM,
    prompt: list[int],
    gen_length: int,
    block_length: int,
    threshold: float,
    relaxed_threshold: float | None = None,
    radius: int = 0,
) -> tuple[torch.Tensor, int]:
    """Fast-dLLM's threshold loop (§3.1) and LocalLeap's variant of it (§2.2), T = 0, no cache.

    Written from the upstream shape, not from the production code: full-canvas logits,
    float64 softmax, confidences outside the block's masks at ``-inf``, all masked positions
    ranked by ``topk``, the first one kept unconditionally, every other one kept iff its
    confidence reaches its *per-position* threshold — τ (``relaxed_threshold``) inside the
    union of ``[a − W, a + W]`` over this step's anchors ``a`` (if any), else κ.
    """
    x = torch.full((len(prompt) + gen_length,), MASK_ID, dtype=torch.long)
    x[: len(prompt)] = torch.tensor(prompt)
    nfe = 0
    for k in range(gen_length // block_length):
        lo = len(prompt) + k * block_length
        hi = lo + block_length
        while bool((x[lo:hi] == MASK_ID).any()):
            masked = x == MASK_ID
            z = model(x)
            z[:, MASK_ID] = -float("inf")  # our guard (dInfer's rm_mask); no-op for this mock
            nfe += 1
            x0 = z.argmax(-1)
            c = torch.softmax(z.double(), -1).gather(-1, x0[:, None]).squeeze(-1)
            c[hi:] = -float("inf")
            c = torch.where(masked, c, torch.tensor(-float("inf"), dtype=torch.float64))
            per_position = torch.full_like(c, threshold)
            if relaxed_threshold is not None:
                anchors = torch.nonzero(c >= threshold).squeeze(1).tolist()
                for a in anchors:
                    per_position[max(a - radius, 0) : a + radius + 1] = relaxed_threshold
            n_masked = int(masked[lo:hi].sum())
            values, order = torch.topk(c, k=n_masked)
            keep = [int(order[0])] + [
                int(i) for v, i in zip(values[1:], order[1:], strict=True) if v >= per_position[i]
            ]
            x[keep] = x0[keep]
    return x, nfe


@pytest.mark.parametrize("model_seed", [0, 1, 2])
@pytest.mark.parametrize(("gen", "block"), [(16, 16), (24, 8), (16, 4)])
def test_threshold_parity_with_reference(gen: int, block: int, model_seed: int) -> None:
    model = MockLM(seed=model_seed, scale=7.0)
    prompt = [5, 17, 8, 30, 11, 1]
    for tau in (0.9, 0.6):
        ref, ref_nfe = reference_threshold_generate(model, prompt, gen, block, tau)
        params = DecodingParams(gen, gen // block, block, confidence_threshold=tau)
        state = LLaDADenoiser(MASK_ID, ()).init_state(prompt, params, "cpu")
        run(LLaDADenoiser(MASK_ID, ()), state, model)
        assert torch.equal(state.canvas, ref) and state.nfe == ref_nfe


@pytest.mark.parametrize("model_seed", [0, 1, 2])
@pytest.mark.parametrize(
    ("kappa", "tau", "radius"), [(0.9, 0.75, 4), (0.8, 0.4, 2), (0.95, 0.5, 9)]
)
def test_local_leap_parity_with_reference(kappa: float, tau: float, radius: int, model_seed: int):
    model = MockLM(seed=model_seed, scale=7.0)
    prompt = [5, 17, 8, 30, 11, 1]
    ref, ref_nfe = reference_threshold_generate(model, prompt, 32, 16, kappa, tau, radius)
    params = DecodingParams(
        32,
        2,
        16,
        use_local_leap=True,
        local_leap_anchor_threshold=kappa,
        local_leap_neighbor_threshold=tau,
        local_leap_radius=radius,
    )
    denoiser = LLaDADenoiser(MASK_ID, ())
    state = denoiser.init_state(prompt, params, "cpu")
    run(denoiser, state, model)
    assert torch.equal(state.canvas, ref) and state.nfe == ref_nfe
