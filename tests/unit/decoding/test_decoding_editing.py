"""LLaDA2.1 token editing (JointThreshold) on the block-diffusion engine.

The re-statement below is the rule as SGLang's ``JointThreshold`` applies it (per block of the
canvas, no cache: full forwards over ``canvas[: end of block]`` with the block-causal mask):

- logits at every position of the block past the prompt, mask id excluded; ``x0`` the argmax,
  ``p`` its probability;
- a step that starts with no mask counts one post-edit step; past ``max_post_edit_steps`` the
  block closes and the step writes nothing;
- M2T: masks with ``p > τ_mask`` (strictly), else the single most confident mask;
- T2T: unmasked positions with ``p > τ_edit`` whose ``x0`` differs from the token there;
- nothing to write: the block closes.

The engine forwards only the open block against its exact cache; answers and forward counts
must agree, edits must fire, and each closed block's cached K/V must equal a fresh
block-causal encode of its final tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from editing_support import SETTINGS, TAU_MASK, prompts

from dllm_serve.config import EngineConfig
from dllm_serve.decoding.block_diffusion import BlockDiffusionDecoder, BlockState
from dllm_serve.decoding.commit_rules import joint_threshold_commit_rows
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.decoding.protocol import AttentionKind, RowSpec
from dllm_serve.engine.model_runner import ModelRunner
from dllm_serve.llm import LLM
from dllm_serve.models.loader import LoadedModel, load_model
from dllm_serve_train.tiny_checkpoints import write_tiny_llada2, write_tiny_sdar

pytestmark = pytest.mark.usefixtures("one_thread")

# The tiny random model is nearly uniform over its 768 tokens (top probabilities ≈ 0.002), so
# ---- the rule on scripted confidences ----------------------------------------------------------


def one_row(
    conf: list[float],
    proposals: list[int],
    current: list[int],
    mask_id: int,
    tau: float,
    tau_edit: float,
) -> list[bool]:
    n = len(conf)
    out = joint_threshold_commit_rows(
        torch.tensor([conf]),
        torch.tensor([proposals]),
        torch.tensor([current]),
        torch.tensor([[c == mask_id for c in current]]),
        torch.ones(1, n, dtype=torch.bool),
        torch.tensor([tau]),
        torch.tensor([tau_edit]),
    )
    return out[0].tolist()


M = 99  # the mask id of the scripted cases


def test_mask_threshold_is_strict_with_the_top_one_fallback() -> None:
    # Exactly at τ is not above it: only the most confident mask (the first of equals).
    assert one_row([0.5, 0.5, 0.2], [1, 2, 3], [M, M, M], M, 0.5, 1.0) == [True, False, False]
    assert one_row([0.5, 0.6, 0.7], [1, 2, 3], [M, M, M], M, 0.5, 1.0) == [False, True, True]


def test_an_edit_needs_a_different_proposal_above_tau_edit() -> None:
    current = [7, 8, 9, M]
    # τ_edit 0: any different argmax is an edit (strictly above 0), the same token is not.
    assert one_row([0.1, 0.1, 0.1, 0.9], [7, 5, 6, 4], current, M, 0.5, 0.0) == [
        False, True, True, True,
    ]  # fmt: skip
    # Above τ_edit only; the masks still follow M2T (here its fallback).
    assert one_row([0.9, 0.3, 0.95, 0.1], [1, 2, 9, 4], current, M, 0.5, 0.8) == [
        True, False, False, True,
    ]  # fmt: skip


def test_no_mask_and_no_change_writes_nothing() -> None:
    assert one_row([0.9, 0.9], [7, 8], [7, 8], M, 0.5, 0.0) == [False, False]


def test_the_prompt_tail_is_never_editable() -> None:
    decoder = BlockDiffusionDecoder(mask_id=M, stop_ids=[0], block_size=4, editing=True)
    params = DecodingParams(gen_length=6, steps=8, edit_threshold=0.0)
    state = decoder.init_state([11, 12, 13, 14, 15, 16], params, "cpu")
    state.phase = "decode"
    decoder._start_block(state)
    assert state.active_block == (4, 8)
    assert state.editable == [6, 7]  # positions 4 and 5 are the prompt's


# ---- the re-statement, no cache --------------------------------------------------------------


@torch.no_grad()
def joint_threshold_loop(
    loaded: LoadedModel, prompt: list[int], params: DecodingParams
) -> tuple[list[int], list[int], int]:
    """(answer tokens, forwards of each block, edits) of the no-cache JointThreshold loop."""
    model, mask, b = loaded.model, loaded.mask_id, loaded.block_size
    assert b is not None and params.edit_threshold is not None
    stops = (*loaded.stop_ids, *params.stop_token_ids)
    total = -(-(len(prompt) + params.gen_length) // b) * b
    x = prompt + [mask] * (total - len(prompt))
    forwards: list[int] = []
    edits = 0

    def answer() -> tuple[list[int], bool]:
        out = []
        for token in x[len(prompt) : len(prompt) + params.gen_length]:
            if token == mask:
                return out, False
            if token in stops:
                return out, True
            out.append(token)
        return out, True

    tau = params.mask_threshold
    for k in range(len(prompt) // b, total // b):
        lo, hi = k * b, (k + 1) * b
        editable = list(range(max(lo, len(prompt)), hi))
        post, n = 0, 0
        while True:
            pos = torch.arange(hi)
            allowed = (pos[None, :] // b) <= (pos[:, None] // b)  # block-causal
            hidden = model(torch.tensor([x[:hi]]), pos[None], allowed[None, None])
            z = model.lm_head(hidden[0, editable]).double()
            n += 1
            z[:, mask] = -float("inf")
            x0 = z.argmax(-1).tolist()
            p = torch.softmax(z, -1).max(-1).values.tolist()
            masks = [i for i, q in enumerate(editable) if x[q] == mask]
            if not masks:
                post += 1
                if post > params.max_post_edit_steps:
                    break
            m2t = [i for i in masks if p[i] > tau]
            if masks and not m2t:
                m2t = [max(masks, key=lambda i: (p[i], -i))]
            t2t = [
                i
                for i, q in enumerate(editable)
                if x[q] != mask and p[i] > params.edit_threshold and x0[i] != x[q]
            ]
            if not m2t and not t2t:
                break
            edits += len(t2t)
            for i in m2t + t2t:
                x[editable[i]] = x0[i]
        forwards.append(n)
        tokens, ended = answer()
        if ended:
            return tokens, forwards, edits
    return answer()[0], forwards, edits


@pytest.fixture(scope="module", params=[4, 32], ids=["block4", "block32"])
def llada2_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = Path(tmp_path_factory.mktemp(f"llada21-{request.param}"))
    return write_tiny_llada2(root / "tiny-llada2", block_size=request.param, seed=3)


@pytest.fixture(scope="module")
def reference_model(llada2_dir: Path) -> LoadedModel:
    return load_model(str(llada2_dir), device="cpu", dtype="float32")


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_engine_equals_the_joint_threshold_loop(
    llada2_dir: Path, reference_model: LoadedModel, setting: str
) -> None:
    params = DecodingParams(gen_length=10, steps=64, **SETTINGS[setting])
    b = reference_model.block_size
    assert b is not None
    edits = 0
    # Forward counts are compared with the cache off (a prompt that shares another's whole
    # blocks skips its prefill); with it on (the default) the answers are the same.
    no_cache = EngineConfig(enable_prefix_caching=False)
    with (
        LLM(str(llada2_dir), device="cpu", dtype="float32", engine_config=no_cache) as llm,
        LLM(str(llada2_dir), device="cpu", dtype="float32") as cached,
    ):
        for prompt in prompts(b):
            (got,) = llm.generate_ids([prompt], [params])
            want, forwards, made = joint_threshold_loop(reference_model, prompt, params)
            edits += made
            assert got.text == reference_model.tokenizer.decode(want, skip_special_tokens=True)
            assert got.completion_tokens == len(want)
            prefill = 1 if len(prompt) >= b else 0
            assert got.nfe == prefill + sum(forwards)
            assert max(forwards) <= b + params.max_post_edit_steps + 1
            assert cached.generate_ids([prompt], [params])[0].text == got.text
    assert edits > 0  # the rule was exercised: tokens were rewritten


def test_edits_change_the_answer(llada2_dir: Path, reference_model: LoadedModel) -> None:
    """The same τ_mask without editing (threshold decoding) answers differently here."""
    b = reference_model.block_size
    assert b is not None
    prompt = prompts(b)[1]
    edit = DecodingParams(gen_length=10, steps=64, confidence_threshold=TAU_MASK,
                          edit_threshold=0.0)  # fmt: skip
    plain = DecodingParams(gen_length=10, steps=64, confidence_threshold=TAU_MASK)
    with LLM(str(llada2_dir), device="cpu", dtype="float32") as llm:
        edited, unedited = llm.generate_ids([prompt, prompt], [edit, plain])
    assert joint_threshold_loop(reference_model, prompt, edit)[2] > 0
    assert edited.text != unedited.text


def test_batched_mixed_rules_equal_each_alone(
    llada2_dir: Path, reference_model: LoadedModel
) -> None:
    b = reference_model.block_size or 1
    settings = [
        DecodingParams(gen_length=10, steps=64, **SETTINGS["s-mode"]),
        DecodingParams(gen_length=9, steps=64),
        DecodingParams(gen_length=10, steps=64, edit_threshold=0.0, temperature=0.9, seed=5),
        DecodingParams(gen_length=10, steps=64, confidence_threshold=TAU_MASK),
        DecodingParams(gen_length=10, steps=64, **SETTINGS["budget-2"]),
    ]
    batch = [prompts(b)[i % 4] for i in range(len(settings))]
    no_cache = EngineConfig(enable_prefix_caching=False)  # forward counts: no prefill skipped
    with LLM(str(llada2_dir), device="cpu", dtype="float32", engine_config=no_cache) as llm:
        together = llm.generate_ids(batch, settings)
        alone = [llm.generate_ids([p], [s])[0] for p, s in zip(batch, settings, strict=True)]
    assert [c.text for c in together] == [c.text for c in alone]
    assert [c.nfe for c in together] == [c.nfe for c in alone]


# ---- the cache -------------------------------------------------------------------------------


def test_closed_blocks_cache_a_fresh_encode_of_their_final_tokens(
    reference_model: LoadedModel,
) -> None:
    loaded = reference_model
    b = loaded.block_size
    assert b is not None
    decoder = BlockDiffusionDecoder(loaded.mask_id, [], b, editing=True)
    runner = ModelRunner(loaded.model, torch.device("cpu"), kv_slots=512)
    pool = runner.pool
    assert pool is not None
    prompt = prompts(b)[1]
    params = DecodingParams(gen_length=3 * b, steps=64, **SETTINGS["s-mode"])
    state: BlockState = decoder.init_state(prompt, params, "cpu")
    state.kv = pool.reserve(decoder.kv_tokens(len(prompt), params))
    assert state.kv is not None
    checked = 0
    with torch.inference_mode():
        while not state.finished:
            kept = state.kv.length
            logits = runner.run([decoder.prepare(state)])
            decoder.commit([state], decoder.sample([state], logits).tolist())
            if state.kv.length <= max(kept, len(prompt) // b * b):
                continue  # no block closed in this step
            n = state.kv.length
            assert mask_free(state.tokens[:n], loaded.mask_id)
            slots = state.kv.slots(0, n)
            keys, values = pool.k[:, slots].clone(), pool.v[:, slots].clone()
            fresh = pool.reserve(n)
            assert fresh is not None
            row = RowSpec(state.tokens[:n], 0, [n - 1], AttentionKind.BLOCK_CAUSAL, kv=fresh,
                          block=b)  # fmt: skip
            runner.run([row])
            want = fresh.slots(0, n)
            assert (keys - pool.k[:, want]).abs().max() <= 1e-5
            assert (values - pool.v[:, want]).abs().max() <= 1e-5
            pool.free(fresh)
            checked += 1
    assert state.edits > 0 and checked >= 2
    pool.free(state.kv)


def mask_free(tokens: list[int], mask_id: int) -> bool:
    return mask_id not in tokens


# ---- which models edit -----------------------------------------------------------------------


def test_a_model_not_trained_to_edit_refuses_edit_threshold(tmp_path: Path) -> None:
    sdar = write_tiny_sdar(tmp_path / "sdar")
    params = DecodingParams(gen_length=8, steps=8, edit_threshold=0.5)
    with (
        LLM(str(sdar), device="cpu", dtype="float32") as llm,
        pytest.raises(ValueError, match=r"edit_threshold .*not trained to edit"),
    ):
        llm.generate_ids([[11, 12, 13]], [params])


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"edit_threshold": 1.5}, "edit_threshold must be in"),
        ({"edit_threshold": 0.0, "use_local_leap": True}, "use_local_leap and edit_threshold"),
        ({"edit_threshold": 0.0, "entropy_bound": 0.1}, "entropy_bound and edit_threshold"),
        ({"edit_threshold": 0.0, "max_post_edit_steps": -1}, "max_post_edit_steps must be"),
    ],
)
def test_params_refuse_contradictions(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DecodingParams(gen_length=8, steps=8, **fields)  # type: ignore[arg-type]


def test_decoding_algorithm_presets_start_only_where_they_apply(tmp_path: Path) -> None:
    sdar = write_tiny_sdar(tmp_path / "sdar")
    with pytest.raises(ValueError, match=r"s_mode: token editing applies to LLaDA2\.x"):
        LLM(str(sdar), device="cpu", dtype="float32",
            engine_config=EngineConfig(decoding_algorithm="s_mode"))  # fmt: skip
    with LLM(str(sdar), device="cpu", dtype="float32",
             engine_config=EngineConfig(decoding_algorithm="eb_sampler")) as llm:  # fmt: skip
        assert llm.engine.default_commit_rule == {"entropy_bound": 0.15}
    with pytest.raises(ValueError, match="decoding_algorithm must be one of"):
        EngineConfig(decoding_algorithm="JointThreshold")


def test_an_editing_checkpoint_decodes_by_its_preset(tmp_path: Path) -> None:
    """make-tiny --family llada2 --editing writes generation_config.json decoding_algorithm
    s_mode: requests that choose no rule decode by LLaDA2.1's S mode; the flag overrides it."""
    from dllm_serve_train.tiny_checkpoints import main

    out = tmp_path / "llada21"
    assert main(["--family", "llada2", str(out), "--block-size", "4", "--editing"]) == 0
    assert (
        json.loads((out / "generation_config.json").read_text())["decoding_algorithm"] == "s_mode"
    )
    assert "token editing" in (out / "README.md").read_text()
    chat = [{"role": "user", "content": "What is 2 + 3?"}]
    s_mode = DecodingParams(gen_length=10, steps=64, confidence_threshold=0.5, edit_threshold=0.0)
    with LLM(str(out), device="cpu", dtype="float32") as llm:
        assert llm.engine.decoding_algorithm == "s_mode"
        (preset,) = llm.chat([chat], max_tokens=10)  # no rule named: the checkpoint's preset
        (explicit,) = llm.generate([chat], s_mode)
    assert preset.text == explicit.text and preset.nfe == explicit.nfe
    flag = EngineConfig(decoding_algorithm="low_confidence")
    with LLM(str(out), device="cpu", dtype="float32", engine_config=flag) as llm:
        assert llm.engine.decoding_algorithm == "low_confidence"
    bad = json.loads((out / "generation_config.json").read_text()) | {"decoding_algorithm": "x"}
    (out / "generation_config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="decoding_algorithm 'x' is not one of"):
        LLM(str(out), device="cpu", dtype="float32")
