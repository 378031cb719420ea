"""The tri-mode engine: each request decodes by its own ``decoding_mode`` through one engine
(rows of different modes share forwards), ``linear_spec`` answers exactly what ``ar`` answers,
and the draft LoRA changes the drafts but never an answer at T = 0."""

from __future__ import annotations

import pytest
import torch
from trimode_support import CPU, admit, greedy_ar

from dllm_serve.config import EngineConfig
from dllm_serve.decoding.linear_spec import LinearSpecDecoder
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.decoding.protocol import AttentionKind, RowSpec
from dllm_serve.decoding.registry import TriModeDecoder
from dllm_serve.engine.model_runner import ModelRunner
from dllm_serve.llm import LLM
from dllm_serve.models.errors import ModelLoadError
from dllm_serve.models.loader import LoadedModel, load_model
from dllm_serve.models.lora import attach_draft_lora

PROMPTS = [[201, 305, 150, 420, 133], [512, 140], [777]]
pytestmark = pytest.mark.usefixtures("one_thread")


def params(mode: str | None, temperature: float = 0.0, seed: int | None = None, **kw):
    return DecodingParams(gen_length=14, steps=14, temperature=temperature, seed=seed,
                          decoding_mode=mode, **kw)  # fmt: skip


def run(llm: LLM, prompts: list[list[int]], per_row: list[DecodingParams]):
    return llm.generate_ids(prompts, per_row)


def test_linear_spec_answers_what_ar_answers_through_the_engine(nemotron: LoadedModel) -> None:
    with LLM.from_loaded(nemotron, EngineConfig(max_waiting_requests=64)) as llm:
        assert llm.engine.decoding_mode == "tri_mode"
        assert llm.engine.default_decoding_mode == "linear_spec"
        ar = run(llm, PROMPTS, [params("ar")] * 3)
        spec = run(llm, PROMPTS, [params("linear_spec")] * 3)
        default = run(llm, PROMPTS, [params(None)] * 3)
    for prompt, a, s, d in zip(PROMPTS, ar, spec, default, strict=True):
        reference, reason = greedy_ar(nemotron, prompt, 14)
        assert a.completion_tokens == len(reference) and a.finish_reason == reason
        assert (s.text, s.finish_reason) == (a.text, a.finish_reason) == (d.text, d.finish_reason)
        assert a.nfe == a.committed and a.drafted == 0  # one token per forward
        assert s.drafted > 0 and s.nfe > 1  # rounds of draft + verify


def test_mixed_modes_and_temperatures_batched_equal_solo(nemotron: LoadedModel) -> None:
    rows = [
        (PROMPTS[0], params("ar")),
        (PROMPTS[1], params("linear_spec", 0.7, seed=3)),
        (PROMPTS[2], params("diffusion")),
        (PROMPTS[0], params("linear_spec")),
        (PROMPTS[1], params("diffusion", 0.9, seed=5, confidence_threshold=0.0015)),
        (PROMPTS[2], params("ar", 0.5, seed=11)),
    ]
    with LLM.from_loaded(nemotron, EngineConfig(max_waiting_requests=64)) as llm:
        batched = run(llm, [p for p, _ in rows], [q for _, q in rows])
        solo = [run(llm, [p], [q])[0] for p, q in rows]
    assert [(c.text, c.finish_reason, c.nfe) for c in batched] == [
        (c.text, c.finish_reason, c.nfe) for c in solo
    ]
    assert batched[2].drafted == 0 and batched[1].drafted > 0  # usage per mode


def test_block_size_tiers_apply_to_linear_spec(nemotron: LoadedModel) -> None:
    config = EngineConfig(max_waiting_requests=64, block_size_tiers=((1, 16), (2, 4)))
    with LLM.from_loaded(nemotron, config) as llm:
        algorithm = llm.engine.algorithm
        assert isinstance(algorithm, TriModeDecoder)
        linear = algorithm.modes["linear_spec"]
        assert isinstance(linear, LinearSpecDecoder) and linear.max_block == 16
        assert linear.kv_tokens(5, params(None)) == 5 + 14 + 16
        spec = run(llm, PROMPTS, [params(None)] * 3)
        ar = run(llm, PROMPTS, [params("ar")] * 3)
    assert [c.text for c in spec] == [c.text for c in ar]
    # Which tier a round gets depends on how many requests are running when it is prepared,
    # which is timing on a loaded machine. A tier that applies from one running request on
    # pins it: every round drafts with the 4-token block, at most 3 drafts in each of the (at
    # most 13) rounds after the seed, where the 16-token block would draft 13 + 12 + ...
    with LLM.from_loaded(nemotron, EngineConfig(block_size_tiers=((1, 4),))) as llm:
        small = run(llm, PROMPTS, [params(None)] * 3)
    assert [c.text for c in small] == [c.text for c in ar]
    assert all(0 < c.drafted <= 3 * 13 for c in small)


@pytest.fixture
def with_lora(nemotron: LoadedModel) -> LoadedModel:
    """The same checkpoint loaded again, with its tiny draft LoRA attached."""
    loaded = load_model(str(nemotron.path), device="cpu", dtype="float32")
    assert attach_draft_lora(loaded.model, nemotron.path.parent / "lora") == 2
    return loaded


def _first_drafts(loaded: LoadedModel) -> list[int]:
    decoder = LinearSpecDecoder(loaded.mask_id, loaded.stop_ids, block_size=8)
    runner = ModelRunner(loaded.model, CPU, kv_slots=64)
    state = admit(runner, decoder, PROMPTS[0], params(None))
    with torch.inference_mode():
        for _ in range(2):  # the prefill, then the draft
            decoder.commit(
                [state], decoder.sample([state], runner.run([decoder.prepare(state)])).tolist()
            )
    return state.specs


def test_draft_lora_changes_drafts_but_never_the_greedy_answer(
    nemotron: LoadedModel, with_lora: LoadedModel
) -> None:
    assert _first_drafts(with_lora) != _first_drafts(nemotron)
    with LLM.from_loaded(with_lora, EngineConfig(max_waiting_requests=64)) as llm:
        spec = run(llm, PROMPTS, [params("linear_spec")] * 3)
        ar = run(llm, PROMPTS, [params("ar")] * 3)
    for prompt, s, a in zip(PROMPTS, spec, ar, strict=True):
        assert s.text == a.text
        assert a.completion_tokens == len(greedy_ar(nemotron, prompt, 14)[0])


@torch.no_grad()
def test_phase_hooks_give_the_same_views_as_the_per_token_lora(
    nemotron: LoadedModel, with_lora: LoadedModel
) -> None:
    """A graph-capturing runtime sets the weight view per phase with the hooks: the merged draft
    view equals the per-token LoRA, the verify view is the base weights bit for bit."""
    runner = ModelRunner(with_lora.model, CPU)
    base = ModelRunner(nemotron.model, CPU)
    block = [PROMPTS[0][-1]] + [with_lora.mask_id] * 7
    draft = RowSpec(block, 0, list(range(8)), AttentionKind.BIDIRECTIONAL, draft=True)
    plain = RowSpec(block, 0, list(range(8)), AttentionKind.BIDIRECTIONAL)
    verify = RowSpec(PROMPTS[0], 0, [0, 2, 4], AttentionKind.CAUSAL)

    def run(on: ModelRunner, row: RowSpec) -> torch.Tensor:
        return on.run([row]).as_padded()

    eager_draft, eager_verify = run(runner, draft), run(runner, verify)
    assert torch.equal(eager_verify, run(base, verify))  # LoRA off outside draft rows
    assert (eager_draft - run(base, draft)).abs().max() > 1e-3  # and on in them
    hooks = runner.phase_hooks
    hooks.before_draft()
    merged_draft = run(runner, plain)
    hooks.before_verify()
    assert torch.equal(run(runner, verify), eager_verify)
    hooks.after_graph()
    assert (merged_draft - eager_draft).abs().max() <= 1e-5
    assert torch.equal(run(runner, draft), eager_draft)  # eager state restored


def test_bad_adapters_are_refused(nemotron: LoadedModel, tmp_path) -> None:
    import json
    import shutil

    lora = tmp_path / "lora"
    shutil.copytree(nemotron.path.parent / "lora", lora)
    config = json.loads((lora / "adapter_config.json").read_text())
    (lora / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj"]}))
    loaded = load_model(str(nemotron.path), device="cpu", dtype="float32")
    with pytest.raises(ModelLoadError, match="only a LoRA on o_proj"):
        attach_draft_lora(loaded.model, lora)
    (lora / "adapter_config.json").write_text(json.dumps({**config, "r": 4}))
    with pytest.raises(ModelLoadError, match="lora_A must be"):
        attach_draft_lora(loaded.model, lora)
