"""Family rules in the denoiser: logit shift (Dream, I-DLM) and causal attention."""

from __future__ import annotations

import pytest
import torch
from decoding_mock import EOS_ID, MASK_ID, VOCAB, MockLM, decode

from dllm_serve.decoding.canvas import LLaDADenoiser
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.decoding.protocol import AttentionKind, RowSpec

PROMPT = [5, 17, 8, 30, 11]
P = len(PROMPT)
MODES = [{}, {"confidence_threshold": 0.9}, {"use_local_leap": True}]


def _code(position: int) -> int:
    """The token a PositionLM proposes from the row at ``position`` (never mask/EOS/EOT)."""
    return 4 + position % 30


class PositionLM:
    """Row ``i`` of the logits confidently proposes ``_code(i)``: it tells where it came from."""

    def forward(self, spec: RowSpec) -> torch.Tensor:
        rows = spec.logits_index
        logits = torch.zeros(rows.numel(), VOCAB)
        logits[torch.arange(rows.numel()), 4 + rows % 30] = 8.0 + rows.float() % 3
        return logits


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shift", [False, True])
def test_shifted_and_unshifted_logits_commit_the_intended_positions(shift: bool, mode) -> None:
    params = DecodingParams(gen_length=12, block_length=4, steps=12, **mode)
    denoiser = LLaDADenoiser(MASK_ID, (), logit_shift=shift)
    state = denoiser.init_state(PROMPT, params, "cpu")
    spec = denoiser.prepare(state)
    masked = torch.arange(P, P + 4)
    assert torch.equal(spec.logits_index, masked - 1 if shift else masked)
    if shift:
        assert spec.logits_index[0].item() == P - 1  # the last prompt position
    state, records = decode(params, PositionLM(), logit_shift=shift)
    for rec in records:
        changed = torch.nonzero(rec.before != rec.after).squeeze(1)
        assert torch.all((changed >= rec.lo) & (changed < rec.hi))  # writes position j ...
        source = changed - 1 if shift else changed  # ... from the row that predicts j
        assert rec.after[changed].tolist() == [_code(int(i)) for i in source]
    assert state.canvas[:P].tolist() == PROMPT
    assert state.canvas[P:].tolist() == [_code(j - shift) for j in range(P, P + 12)]


def _greedy_autoregressive(model: MockLM, prompt: list[int], n: int, shift: bool) -> list[int]:
    """Plain AR decoding of a causal model, one token per forward (the reference)."""
    x = list(prompt)
    for _ in range(n):
        if shift:  # the last position predicts the next token
            z = model(torch.tensor(x), causal=True)[-1]
        else:  # a mask placeholder at the new position predicts itself
            z = model(torch.tensor([*x, MASK_ID]), causal=True)[-1]
        z[MASK_ID] = -float("inf")
        x.append(int(z.argmax()))
    return x


@pytest.mark.parametrize("shift", [True, False])
@pytest.mark.parametrize("model_seed", [0, 1, 2])
def test_causal_block_length_one_is_greedy_autoregressive(shift: bool, model_seed: int) -> None:
    model = MockLM(seed=model_seed, scale=2.0)
    gen = 16
    reference = _greedy_autoregressive(model, PROMPT, gen, shift)
    params = DecodingParams(gen_length=gen, block_length=1, steps=gen)
    state, _ = decode(params, model, logit_shift=shift, bidirectional=False)
    assert state.canvas.tolist() == reference
    assert state.nfe == gen
    # the AR path really differs from what bidirectional attention would give
    bidir, _ = decode(params, model, logit_shift=shift)
    assert bidir.canvas.tolist() != reference


def test_attention_kind_and_empty_prompt() -> None:
    params = DecodingParams(gen_length=4, steps=4)
    causal = LLaDADenoiser(MASK_ID, (EOS_ID,), bidirectional=False)
    assert causal.prepare(causal.init_state(PROMPT, params, "cpu")).attention is (
        AttentionKind.CAUSAL
    )
    bidir = LLaDADenoiser(MASK_ID, (EOS_ID,))
    assert bidir.prepare(bidir.init_state(PROMPT, params, "cpu")).attention is (
        AttentionKind.BIDIRECTIONAL
    )
    # an unshifted model can decode from an empty prompt; a shifted one cannot
    assert bidir.init_state([], params, "cpu").canvas.tolist() == [MASK_ID] * 4
    with pytest.raises(ValueError, match="non-empty prompt"):
        LLaDADenoiser(MASK_ID, (), logit_shift=True).init_state([], params, "cpu")
