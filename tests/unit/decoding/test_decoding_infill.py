"""Infilling: ``/v1/completions`` ``suffix`` on bidirectional canvas models (LLaDA, Dream).

The reference places the suffix after the canvas and runs LLaDA's loop at T = 0 (one block,
one commit per step, full bidirectional forwards over prompt + canvas + suffix); the engine's
answer must be that canvas, cut at its first stop id. Causal and block-causal models refuse a
suffix (400 through the API, ValueError offline).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dllm_serve.decoding.params import DecodingParams
from dllm_serve.llm import LLM, InvalidRequestError
from dllm_serve.models.loader import LoadedModel, load_model
from dllm_serve_train.tiny_checkpoints import write_tiny_dream, write_tiny_llada, write_tiny_sdar

pytestmark = pytest.mark.usefixtures("one_thread")


@torch.no_grad()
def infill_loop(
    loaded: LoadedModel, prompt: list[int], gen_length: int, suffix: list[int], shift: int
) -> list[int]:
    """The canvas between ``prompt`` and ``suffix`` (cut at its first stop id)."""
    mask = loaded.mask_id
    x = prompt + [mask] * gen_length + suffix
    lo = len(prompt)
    n = len(x)
    every = torch.ones(1, 1, n, n, dtype=torch.bool)
    for _ in range(gen_length):
        masked = [p for p in range(lo, lo + gen_length) if x[p] == mask]
        hidden = loaded.model(torch.tensor([x]), torch.arange(n)[None], every)
        z = loaded.model.lm_head(hidden[0, [p - shift for p in masked]]).double()
        z[:, mask] = -float("inf")
        conf = torch.softmax(z, -1).max(-1).values
        best = int(conf.argmax())  # the first of equals, as the engine's stable ranking
        x[masked[best]] = int(z[best].argmax())
    answer = []
    for token in x[lo : lo + gen_length]:
        if token in loaded.stop_ids:
            break
        answer.append(token)
    return answer


@pytest.mark.parametrize(("writer", "shift"), [(write_tiny_llada, 0), (write_tiny_dream, 1)])
def test_the_canvas_is_decoded_between_prompt_and_suffix(
    tmp_path: Path, writer, shift: int
) -> None:  # type: ignore[no-untyped-def]
    path = writer(tmp_path / "m")
    loaded = load_model(str(path), device="cpu", dtype="float32")
    prompt, suffix, gen = [11, 12, 13, 14], [21, 22, 23], 8
    with LLM(str(path), device="cpu", dtype="float32") as llm:
        params = DecodingParams(gen_length=gen, steps=gen, suffix_ids=tuple(suffix))
        (got,) = llm.generate_ids([prompt], [params])
        (plain,) = llm.generate_ids([prompt], [DecodingParams(gen_length=gen, steps=gen)])
        # Through the API's pipeline: the suffix as text, tokenized without special tokens.
        text = loaded.tokenizer.decode(suffix)
        prompt_text = loaded.tokenizer.decode(prompt)
        (api,) = llm.complete([prompt_text], suffix=text, max_tokens=gen, num_denoising_steps=gen)
    want = infill_loop(loaded, prompt, gen, suffix, shift)
    assert got.text == loaded.tokenizer.decode(want, skip_special_tokens=True)
    assert got.text != plain.text  # the suffix changed the answer: the canvas saw it
    assert api.completion_tokens <= gen and api.prompt_tokens >= 1


def test_block_causal_and_causal_models_refuse_a_suffix(tmp_path: Path) -> None:
    with LLM(str(write_tiny_sdar(tmp_path / "sdar")), device="cpu", dtype="float32") as llm:
        with pytest.raises(InvalidRequestError) as refused:
            llm.complete(["2 + 2 ="], suffix=" is four", max_tokens=8)
        assert (refused.value.param, refused.value.code) == ("suffix", "not_applicable")
        params = DecodingParams(gen_length=8, steps=8, suffix_ids=(5, 6))
        with pytest.raises(ValueError, match="suffix"):
            llm.generate_ids([[11, 12]], [params])


def test_the_suffix_counts_against_the_context(tmp_path: Path) -> None:
    with LLM(str(write_tiny_llada(tmp_path / "llada")), device="cpu", dtype="float32") as llm:
        room = llm.engine.max_length
        with pytest.raises(InvalidRequestError) as refused:
            llm.complete(["a"], suffix=" b" * room, max_tokens=8)
        assert refused.value.code == "context_length_exceeded"
