"""Nemotron-Labs-Diffusion: the family against transformers' Ministral3 modules, in both views.

The tiny checkpoint is written in the real format (``make-tiny --family nemotron``) with
perturbed norms; its YaRN context is 128 positions, so rows placed past 128 exercise YaRN and
the Llama-4 query scaling as well. Causal = the AR view; bidirectional = the diffusion view,
alone and as a block over a causal prefix read from the KV pool (the serving path).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_reference import perturb_norms
from nemotron_reference import ministral3_reference, reference_logits

from dllm_serve.decoding.protocol import AttentionKind, RowSpec
from dllm_serve.engine.model_runner import ModelRunner
from dllm_serve.models.families import NEMOTRON, UnsupportedModelError, family_for
from dllm_serve.models.loader import load_model
from dllm_serve_train.tiny_checkpoints import write_tiny_nemotron

TOL = 1e-5
FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "nemotron-labs-diffusion-8b"


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory: pytest.TempPathFactory):
    path = write_tiny_nemotron(tmp_path_factory.mktemp("nemotron") / "n", seed=3, block_size=8)
    perturb_norms(path)
    return load_model(str(path), dtype="float32"), ministral3_reference(path)


def ids_at(vocab: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(128, vocab, (n,), generator=g).tolist()  # past the control block


def ours_padded(model, ids: list[int], positions: list[int], allowed: torch.Tensor | None):
    mask = None if allowed is None else allowed[None, None]
    hidden = model(torch.tensor([ids]), torch.tensor([positions]), mask)
    return model.lm_head(hidden)[0]


@pytest.mark.parametrize("start", [0, 120, 300])  # inside, across and past the YaRN context
@torch.no_grad()
def test_causal_view_matches_ministral3(nemotron, start: int) -> None:
    loaded, ref = nemotron
    n = 20
    ids, pos = ids_at(loaded.vocab_size, n, start), list(range(start, start + n))
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    want = reference_logits(ref, ids, pos, causal)
    assert (ours_padded(loaded.model, ids, pos, causal) - want).abs().max() <= TOL


@pytest.mark.parametrize("start", [0, 300])
@torch.no_grad()
def test_bidirectional_view_matches_ministral3(nemotron, start: int) -> None:
    loaded, ref = nemotron
    n = 12
    ids, pos = ids_at(loaded.vocab_size, n, 7 + start), list(range(start, start + n))
    full = torch.ones(n, n, dtype=torch.bool)
    want = reference_logits(ref, ids, pos, full)
    mine = ours_padded(loaded.model, ids, pos, None)
    assert (mine - want).abs().max() <= TOL
    # Teeth: the causal view is clearly different on the same tokens.
    causal = reference_logits(ref, ids, pos, full.tril())
    assert (mine - causal).abs().max() > 100 * TOL


@torch.no_grad()
def test_query_scaling_is_applied_past_the_original_context(nemotron) -> None:
    """The Llama-4 factor is 1 inside the original context, so positions past it must differ
    from the same model without it (what parity at start=300 relies on)."""
    loaded, _ = nemotron
    model = loaded.model
    n, start = 10, 300
    ids, pos = ids_at(loaded.vocab_size, n, 1), list(range(start, start + n))
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    mine = ours_padded(model, ids, pos, causal)
    scale = model.config.query_scale
    assert scale is not None and scale.length == 128 and scale.beta == pytest.approx(0.1)
    object.__setattr__(model.config, "query_scale", None)
    try:
        unscaled = ours_padded(model, ids, pos, causal)
    finally:
        object.__setattr__(model.config, "query_scale", scale)
    # Random tiny weights give small attention logits, so the effect is modest but still far
    # above the parity tolerance.
    assert (mine - unscaled).abs().max() > 20 * TOL
    inside = list(range(10, 10 + n))
    assert torch.equal(scale.factors(torch.tensor(inside)), torch.ones(n))


@torch.no_grad()
def test_block_over_causal_prefix_through_the_kv_pool(nemotron) -> None:
    """The serving path: a causal prefill writes the prefix's K/V to the pool; a block then
    attends to that prefix and bidirectionally to itself (the diffusion view), and a causal
    row continues it (the AR view). Each against Ministral3 over the whole sequence with the
    same attention pattern. The block sits past the YaRN context (positions 140-147)."""
    loaded, ref = nemotron
    runner = ModelRunner(loaded.model, torch.device("cpu"), kv_slots=256)
    assert runner.pool is not None
    span = runner.pool.reserve(160)
    assert span is not None
    p, b = 140, 8
    prompt = ids_at(loaded.vocab_size, p, 11)
    block = [prompt[-1] + 1] + [loaded.mask_id] * (b - 1)
    runner.run([RowSpec(prompt, 0, [p - 1], AttentionKind.CAUSAL, span)])
    span.length = p
    diff = runner.run([RowSpec(block, p, list(range(b)), AttentionKind.BIDIRECTIONAL, span)])[0]
    causal = runner.run([RowSpec(block, p, list(range(b)), AttentionKind.CAUSAL, span)])[0]
    n = p + b
    allowed = torch.ones(n, n, dtype=torch.bool).tril()
    allowed[p:, p:] = True  # the block sees itself bidirectionally, the prefix causally
    want = reference_logits(ref, prompt + block, list(range(n)), allowed)[p:]
    assert (diff - want).abs().max() <= TOL
    want_causal = reference_logits(ref, prompt + block, list(range(n)), allowed.tril())[p:]
    assert (causal - want_causal).abs().max() <= TOL


def test_real_config_builds_the_8b_shape() -> None:
    config = json.loads((FIXTURE / "config.json").read_text())
    family = family_for(config)
    assert family is NEMOTRON and family.tri_mode
    tcfg = family.transformer_config(config)
    assert (tcfg.d_model, tcfg.n_layers, tcfg.n_heads, tcfg.n_kv_heads, tcfg.head_dim) == (
        4096, 34, 32, 8, 128,
    )  # fmt: skip
    assert tcfg.rope_scaling is not None and tcfg.rope_scaling.rope_type == "yarn"
    assert tcfg.rope_scaling.factor == 16.0
    assert tcfg.query_scale is not None and tcfg.query_scale.length == 16384
    assert family.block_size(config, None) == 32
    names = family.weight_map(tcfg)
    assert len(names) == 34 * 9 + 3
    assert "encoder.layers.33.self_attn.o_proj.weight" in names
    assert names["diffusion_head.weight"] == "head.weight"


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("dlm_paradigm", "block_diff", "dlm_paradigm='block_diff'"),
        ("dlm_paradigm", "autoregressive", "dlm_paradigm='autoregressive'"),
        ("sliding_window", 4096, "sliding_window=4096"),
        ("attention_bias", True, "attention_bias=True"),
        ("num_ar_layers", 4, "num_ar_layers=4"),
        ("block_size", 0, "block_size"),
    ],
)
def test_refuses_what_it_does_not_build(key: str, value: object, message: str) -> None:
    config = json.loads((FIXTURE / "config.json").read_text())
    config[key] = value
    with pytest.raises(UnsupportedModelError, match=message):
        family_for(config).transformer_config(config)


def test_make_tiny_writes_the_real_format_and_a_peft_draft_lora(tmp_path: Path) -> None:
    from safetensors import safe_open

    from dllm_serve_train.tiny_checkpoints import main

    ckpt, lora = tmp_path / "ckpt", tmp_path / "lora"
    args = [str(ckpt), "--family", "nemotron", "--block-size", "8", "--draft-lora-out", str(lora)]
    assert main(args) == 0
    real = json.loads((FIXTURE / "config.json").read_text())
    config = json.loads((ckpt / "config.json").read_text())
    assert list(config) == list(real)  # every real key, in the real order
    assert {k: config[k] for k in ("bos_token_id", "eos_token_id", "mask_token_id")} == {
        "bos_token_id": 1, "eos_token_id": 11, "mask_token_id": 100,
    }  # fmt: skip
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert names == set(NEMOTRON.weight_map(NEMOTRON.transformer_config(config)))
    adapter = json.loads((lora / "adapter_config.json").read_text())
    assert adapter["target_modules"] == ["o_proj"] and adapter["lora_alpha"] == 4 * adapter["r"]
    with safe_open(str(lora / "adapter_model.safetensors"), "pt") as f:
        lora_names = set(f.keys())
    assert lora_names == {
        f"base_model.model.encoder.layers.{i}.self_attn.o_proj.lora_{ab}.weight"
        for i in range(config["num_hidden_layers"])
        for ab in "AB"
    }
    loaded = load_model(str(ckpt), dtype="float32")
    assert (loaded.mask_id, loaded.stop_ids, loaded.block_size) == (100, (11,), 8)
    assert loaded.tokenizer.decode(loaded.chat_prompt_ids([{"role": "user", "content": "Hi"}]))
