"""Fast-dLLM v2 through the block-diffusion engine == the official loop without a cache.

The reference (``fastdllm_reference.py``) is the official ``generate`` written plainly: full
block-causal forwards over the canvas up to the active block, the token shift, sub-blocks of 8
left to right, the threshold rule, the next block's first token from the finished block's last
logit. The engine forwards only the active block against its exact KV cache; the two must
agree token for token, forward for forward, for prompts that end on a block boundary, one
past it, one before it, inside the first block, and exactly one block long.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fastdllm_reference import reference

from dllm_serve.config import EngineConfig
from dllm_serve.decoding.block_diffusion import BlockState
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.engine.outputs import RequestOutput
from dllm_serve.llm import LLM
from dllm_serve.models.loader import LoadedModel, load_model
from dllm_serve_train.tiny_checkpoints import write_tiny_fastdllm

# The tiny random model is nearly uniform over its 832 tokens (top probabilities around
# 0.0012-0.0016), so this threshold commits several positions in some steps and only the most
# probable one in others; the tests check that both happen.
THRESHOLD = 0.0014


@pytest.fixture(scope="module", params=[32, 16], ids=["block32", "block16"])
def fastdllm_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Fast-dLLM v2 checkpoint (``make-tiny --family fastdllm``): the real block 32
    (four sub-blocks), or 16 (two) for more blocks per answer."""
    root = Path(tmp_path_factory.mktemp(f"fastdllm-{request.param}"))
    return write_tiny_fastdllm(root / "tiny-fastdllm", block_size=request.param, seed=4)


@pytest.fixture(scope="module")
def reference_model(fastdllm_dir: Path) -> LoadedModel:
    return load_model(str(fastdllm_dir), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def llm(fastdllm_dir: Path) -> Iterator[LLM]:
    # Forward by forward as the official loop: no prefix cache (its prompts share prefixes).
    config = EngineConfig(enable_prefix_caching=False)
    with LLM(str(fastdllm_dir), device="cpu", dtype="float32", engine_config=config) as llm:
        assert llm.engine.decoding_mode == "block_diffusion"
        yield llm


class Recorder:
    """The engine's counters per forward (rows and tokens fed, through its observer hook) and
    the state of every request (read when it commits: its final answer tokens)."""

    def __init__(self, llm: LLM) -> None:
        self.forwards: list[tuple[int, int]] = []
        self.states: list[BlockState] = []
        self.engine, self.real_commit = llm.engine, llm.engine.algorithm.commit
        self.observer = llm.engine.observer

        def commit(states, host):  # type: ignore[no-untyped-def]
            self.states.extend(s for s in states if s not in self.states)
            return self.real_commit(states, host)

        self.engine.algorithm.commit = commit  # type: ignore[method-assign]
        self.engine.observer = self

    @property
    def fed(self) -> list[int]:
        return [tokens for _, tokens in self.forwards]

    def clear(self) -> None:
        self.forwards.clear()
        self.states.clear()

    def on_forward(self, rows: int, tokens: int, model_seconds: float, graphed: bool) -> None:
        self.forwards.append((rows, tokens))

    def on_iteration(self, busy_seconds: float) -> None:
        self.observer.on_iteration(busy_seconds)

    def on_first_content(self, seconds_since_arrival: float) -> None:
        self.observer.on_first_content(seconds_since_arrival)

    def on_finished(self, output: RequestOutput, seconds_since_arrival: float) -> None:
        self.observer.on_finished(output, seconds_since_arrival)

    def restore(self) -> None:
        self.engine.algorithm.commit = self.real_commit  # type: ignore[method-assign]
        self.engine.observer = self.observer


@pytest.fixture
def recorder(llm: LLM) -> Iterator[Recorder]:
    rec = Recorder(llm)
    yield rec
    rec.restore()


def prompts(b: int) -> list[list[int]]:
    """Prompt lengths ≡ 0, 1 and B-1 (mod B), shorter than a block, and exactly one block."""
    return [list(range(11, 11 + n)) for n in (2 * b, 2 * b + 1, 2 * b - 1, 3, b)]


# name → (engine request, the reference's rule)
SETTINGS = {
    # The default top-k with at least 8 steps per sub-block: one token per forward, the most
    # probable — the official loop at its default threshold 1 (its published evaluations).
    "one-per-step": ({"steps": 64}, {"threshold": 1.0}),
    "threshold": ({"steps": 64, "confidence_threshold": THRESHOLD}, {"threshold": THRESHOLD}),
    "fewer-steps": ({"steps": 12}, {"steps": 12}),  # top-k: 3 (block 32) / 6 (16) per sub-block
}
GEN = 37  # crosses one or two block boundaries, ends mid-block


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_engine_equals_the_official_loop(
    llm: LLM, reference_model: LoadedModel, recorder: Recorder, setting: str
) -> None:
    request, rule = SETTINGS[setting]
    params = DecodingParams(gen_length=GEN, **request)
    b = reference_model.block_size
    assert b is not None
    commits: list[int] = []
    for prompt in prompts(b):
        recorder.clear()
        (got,) = llm.generate_ids([prompt], [params])
        want, steps = reference(reference_model, prompt, GEN, **rule)
        commits += steps
        (state,) = recorder.states
        assert state.answer_tokens() == want
        assert got.completion_tokens == len(want) and got.finish_reason == "length"
        assert got.text == reference_model.tokenizer.decode(want, skip_special_tokens=True)
        # The exact cache: a prefill of the prompt's whole blocks (once), then only the
        # active block per forward, denoising or writing it; one forward per reference step.
        prefill = [len(prompt) // b * b] if len(prompt) >= b else []
        assert recorder.fed[: len(prefill)] == prefill
        assert set(recorder.fed[len(prefill) :]) == {b}
        assert got.nfe == state.nfe == len(recorder.fed) == len(steps)
        assert state.committed == sum(steps)
    if setting == "threshold":  # the rule was exercised both ways
        assert max(commits) > 1 and 1 in commits
    if setting == "one-per-step":
        assert set(commits) <= {0, 1}


def test_first_token_of_a_block_is_the_previous_blocks_last_logit(
    llm: LLM, reference_model: LoadedModel, recorder: Recorder
) -> None:
    """At any temperature (as the official loop): sample at T = 1, then check every block's
    first answer token against a block-causal forward over the final canvas."""
    b = reference_model.block_size
    assert b is not None
    prompt = prompts(b)[0]  # ends on a block boundary: the prefill gives the first token too
    params = DecodingParams(gen_length=3 * b, steps=64, temperature=1.0, seed=7, ignore_eos=True)
    llm.generate_ids([prompt], [params])
    (state,) = recorder.states
    canvas = state.tokens[: len(prompt) + 3 * b]
    model = reference_model.model
    pos = torch.arange(len(canvas))
    allowed = (pos[None, :] // b) <= (pos[:, None] // b)
    with torch.no_grad():
        z = model.lm_head(model(torch.tensor([canvas]), pos[None], allowed[None, None])[0])
    z[:, reference_model.mask_id] = -float("inf")
    starts = range(len(prompt), len(canvas), b)
    assert len(starts) == 3
    assert [canvas[p] for p in starts] == [int(z[p - 1].argmax()) for p in starts]
    # The rest is sampled: not all of it is what argmax would give.
    shifted = z[len(prompt) - 1 : len(canvas) - 1].argmax(-1).tolist()
    assert shifted != canvas[len(prompt) :]


def test_stops_end_the_answer_exactly(
    llm: LLM, reference_model: LoadedModel, recorder: Recorder
) -> None:
    """The model's stops are <|im_end|> and <|endoftext|>; any token as a stop cuts the answer
    there, also a block's first token (given by the write forward, before its block decodes)."""
    tok = reference_model.tokenizer
    ends = {tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    assert set(reference_model.stop_ids) == ends
    b = reference_model.block_size
    assert b is not None
    prompt = prompts(b)[2]  # ends one before a block boundary
    free, _ = reference(reference_model, prompt, GEN)
    new = [i for i in range(len(free)) if free.index(free[i]) == i]  # first occurrences
    start = 1  # the first token of the second answer block: from the write forward
    middle = next(i for i in new if i > 2 and (len(prompt) + i) % b)
    assert start in new
    for cut in (start, middle):
        stop = free[cut]
        want, steps = reference(reference_model, prompt, GEN, stop_ids=(stop,))
        assert free.index(stop) == cut and want == free[:cut]
        recorder.clear()
        params = DecodingParams(gen_length=GEN, steps=64, stop_token_ids=(stop,))
        (got,) = llm.generate_ids([prompt], [params])
        assert got.finish_reason == "stop" and recorder.states[0].answer_tokens() == want
        assert got.nfe == len(steps)


def test_sixteen_mixed_requests_batched_equal_each_alone(
    llm: LLM, reference_model: LoadedModel, recorder: Recorder
) -> None:
    b = reference_model.block_size
    assert b is not None
    mixed = [
        {"steps": 64},
        {"steps": 64, "confidence_threshold": THRESHOLD},
        {"steps": 12},
        {"steps": 64, "temperature": 0.9, "seed": 5},
        {"steps": 64, "use_local_leap": True, "local_leap_anchor_threshold": 0.0016,
         "local_leap_neighbor_threshold": 0.0012},
        {"steps": 20, "block_schedule": "cosine"},
        {"steps": 64, "confidence_threshold": THRESHOLD, "temperature": 0.7, "seed": 3},
        {"steps": 64, "ignore_eos": True},
    ]  # fmt: skip
    settings = [DecodingParams(gen_length=GEN - i % 3, **mixed[i % len(mixed)]) for i in range(16)]
    batch = [prompts(b)[i % 5] for i in range(16)]
    together = llm.generate_ids(batch, settings)
    batched = max(rows for rows, _ in recorder.forwards)
    tokens_together = answers(recorder.states)
    recorder.clear()
    alone = [llm.generate_ids([p], [s])[0] for p, s in zip(batch, settings, strict=True)]
    assert max(rows for rows, _ in recorder.forwards) == 1 < batched
    assert llm.engine.kv_cache_bytes == 0  # every span back in the pool
    assert answers(recorder.states) == tokens_together and len(tokens_together) == 16
    assert [c.text for c in together] == [c.text for c in alone]
    assert [c.nfe for c in together] == [c.nfe for c in alone]


def answers(states: list[BlockState]) -> dict[tuple, list[int]]:
    """Each request's answer tokens, by (prompt, parameters): unique in the mixed batch."""
    return {(tuple(s.tokens[: s.prompt_len]), s.params): s.answer_tokens() for s in states}


def test_the_write_cannot_be_fused(llm: LLM) -> None:
    algorithm = llm.engine.algorithm
    assert algorithm.fuse_write is False  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="first token"):
        algorithm.fuse_write = True  # type: ignore[union-attr]
