"""DiffusionGemma (``diffusion_gemma``): config forms, the loader on the real layout, and our
two-mode forward against transformers 5.25's ``DiffusionGemmaForBlockDiffusion`` (fp32)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dllm_serve.decoding.protocol import AttentionKind, RowSpec
from dllm_serve.engine.model_runner import BatchPacker, ModelRunner
from dllm_serve.models.diffusion_gemma import DiffusionGemmaConfig, DiffusionGemmaModel
from dllm_serve.models.errors import ModelLoadError
from dllm_serve.models.families import DIFFUSION_GEMMA, UnsupportedModelError, family_for
from dllm_serve.models.loader import load_model
from dllm_serve_train.tiny_checkpoints import main, write_tiny_diffusion_gemma

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DiffusionGemmaForBlockDiffusion"):  # pragma: no cover
    if os.environ.get("DLLM_REQUIRE_TRANSFORMERS_REFERENCE"):  # CI: the reference must run
        raise RuntimeError("transformers >= 5.25 (DiffusionGemma's reference) is not installed")
    pytest.skip("transformers >= 5.25 (DiffusionGemma) is needed", allow_module_level=True)

CAUSAL, BIDIR = AttentionKind.CAUSAL, AttentionKind.BIDIRECTIONAL


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_diffusion_gemma(Path(tmp_path_factory.mktemp("dg")) / "tiny-dg", seed=3)


@pytest.fixture(scope="module")
def sharp(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with weights that exercise every branch: large embeddings (logits
    well into the soft cap), random norms, router scales and per-mode layer scalars."""
    out = Path(tmp_path_factory.mktemp("dg-sharp")) / "sharp"
    shutil.copytree(tiny, out)
    tensors = load_file(out / "model.safetensors")
    gen = torch.Generator().manual_seed(11)
    for name, t in tensors.items():
        if not name.startswith("model.decoder.") and "layer_scalar" not in name:
            continue
        noise = torch.randn(t.shape, generator=gen)
        if name == "model.decoder.embed_tokens.weight":
            t = noise * 1.0
        elif name.endswith(("norm.weight", "scale")):
            t = t.float() + 0.3 * noise
        elif name.endswith("layer_scalar"):
            t = t.float() + 0.2 * noise
        elif t.dim() >= 2:
            t = noise * 0.15
        tensors[name] = t.to(torch.bfloat16).contiguous()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def config_of(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


# ---- config and loader ---------------------------------------------------------------------


def released_config() -> dict:
    """The released 26B-A4B text config's keys (reference diffusiongemma.md §2.1)."""
    types = (["sliding_attention"] * 5 + ["full_attention"]) * 5
    text = {
        "model_type": "diffusion_gemma_text", "vocab_size": 262144, "hidden_size": 2816,
        "intermediate_size": 2112, "num_hidden_layers": 30, "num_attention_heads": 16,
        "head_dim": 256, "num_key_value_heads": 8, "global_head_dim": 512,
        "num_global_key_value_heads": 2, "layer_types": types, "sliding_window": 1024,
        "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "num_experts": 128,
        "top_k_experts": 8, "moe_intermediate_size": 704,
        "use_bidirectional_attention": "vision", "tie_word_embeddings": True,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {
                "rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6,
            },
        },
    }  # fmt: skip
    return {
        "model_type": "diffusion_gemma", "architectures": ["DiffusionGemmaForBlockDiffusion"],
        "canvas_length": 256, "text_config": text, "tie_word_embeddings": True,
        "eos_token_id": [1, 106],
    }  # fmt: skip


def test_the_released_config_parses() -> None:
    config = released_config()
    assert family_for(config) is DIFFUSION_GEMMA
    cfg = DIFFUSION_GEMMA.transformer_config(config)
    assert isinstance(cfg, DiffusionGemmaConfig)
    full = [i for i, s in enumerate(cfg.layers) if not s.sliding]
    assert full == [5, 11, 17, 23, 29]
    assert {(s.head_dim, s.n_kv_heads, s.k_eq_v) for s in cfg.layers if s.sliding} == {
        (256, 8, False)
    }
    assert {(s.head_dim, s.n_kv_heads, s.k_eq_v) for s in cfg.layers if not s.sliding} == {
        (512, 2, True)
    }
    # One KV slot holds the widest layer's K (8 × 256); the full layers use half of it.
    assert (cfg.n_kv_heads, cfg.head_dim) == (1, 2048)
    assert cfg.sliding_window == 1024 and cfg.final_logit_softcapping == 30.0
    assert cfg.canvas_length == 256 and cfg.moe is not None and cfg.moe.top_k == 8
    # The released text tensors: 661 under model.decoder.*, 30 encoder layer scalars.
    names = DIFFUSION_GEMMA.weight_map(cfg)
    assert len(names) == 691
    assert sum(n.startswith("model.decoder.") for n in names) == 661
    full_rope = cfg.layers[5].rope.inv_freq(512)
    assert full_rope.shape == (256,) and int((full_rope > 0).sum()) == 64  # proportional


def test_both_config_forms_give_the_same_network(tiny: Path, tmp_path: Path) -> None:
    """The released form (global_head_dim) and transformers 5.25's saved form
    (per_layer_config) describe the same layers."""
    released = DIFFUSION_GEMMA.transformer_config(config_of(tiny))
    ref = transformers.DiffusionGemmaConfig.from_pretrained(tiny)
    ref.save_pretrained(tmp_path)
    saved = config_of(tmp_path)
    assert "per_layer_config" in saved["text_config"]
    assert "global_head_dim" not in saved["text_config"]
    assert DIFFUSION_GEMMA.transformer_config(saved) == released


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
        ({"num_experts": None}, "num_experts"),
        ({"hidden_activation": "silu"}, "hidden_activation"),
        ({"layer_types": ["sliding_attention"]}, "layer_types"),
    ],
)
def test_unsupported_configs_are_refused(tiny: Path, change: dict, match: str) -> None:
    config = config_of(tiny)
    config["text_config"] = {**config["text_config"], **change}
    with pytest.raises(UnsupportedModelError, match=match):
        DIFFUSION_GEMMA.transformer_config(config)


def test_loader_reads_the_real_layout(tiny: Path) -> None:
    loaded = load_model(str(tiny))
    model = loaded.model
    assert isinstance(model, DiffusionGemmaModel)
    # The encoder's scalars load apart from the decoder's (the writer sets 0.75 / 1.25).
    assert all(float(layer.encoder_layer_scalar) == 0.75 for layer in model.layers)
    assert all(float(layer.layer_scalar) == 1.25 for layer in model.layers)
    assert model.layers[-1].self_attn.v_proj is None  # full layer: K = V
    assert model.layers[0].self_attn.v_proj is not None
    # EOS set from both files: config [eos, <turn|>] and generation_config's three.
    tok = loaded.tokenizer
    ids = {tok.convert_tokens_to_ids(t) for t in ("<eos>", "<turn|>", "<|tool_response>")}
    assert set(loaded.stop_ids) == ids


def test_a_missing_encoder_scalar_is_a_load_error(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "broken"
    shutil.copytree(tiny, out)
    tensors = load_file(out / "model.safetensors")
    del tensors["model.encoder.language_model.layers.1.layer_scalar"]
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"layers\.1\.layer_scalar"):
        load_model(str(out))


def test_make_tiny_writes_the_format(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["--family", "diffusion_gemma", str(tmp_path / "t"), "--n-layers", "2"]) == 0
    config = config_of(tmp_path / "t")
    assert config["model_type"] == "diffusion_gemma"
    assert config["text_config"]["layer_types"] == ["sliding_attention", "full_attention"]
    gen = json.loads((tmp_path / "t" / "generation_config.json").read_text())
    assert gen["max_denoising_steps"] == 48 and gen["t_max"] == 0.8 and gen["t_min"] == 0.4
    assert gen["sampler_config"]["entropy_bound"] == 0.1 and len(gen["eos_token_id"]) == 3
    names = set(load_file(tmp_path / "t" / "model.safetensors"))
    assert "lm_head.weight" not in names
    assert any(n.startswith("model.encoder.vision_tower.") for n in names)


# ---- the forward against transformers --------------------------------------------------------


def reference(path: Path) -> torch.nn.Module:
    ref = transformers.DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=torch.float32)
    return ref.eval()


def ours(path: Path) -> ModelRunner:
    loaded = load_model(str(path), dtype="float32")
    return ModelRunner(loaded.model, torch.device("cpu"), kv_slots=1024)


def softcapped(ref: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    logits = ref.lm_head(hidden).float()
    return torch.tanh(logits / 30.0) * 30.0


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal within 1e-4 relative to the logits' scale (fp32)."""
    scale = b.abs().max().item()
    assert (a - b).abs().max().item() <= 1e-4 * scale, ((a - b).abs().max().item(), scale)


def test_encoder_and_decoder_logits_equal_transformers(sharp: Path) -> None:
    """Prompt (longer than the sliding window) → encoder logits; canvas → decoder logits,
    without and with a self-conditioning signal; commit the canvas (an encoder pass), then a
    second canvas over the longer prefix. Sliding and K = V layers, soft-capping and the MoE
    are all in the tiny model."""
    ref, runner = reference(sharp), ours(sharp)
    model = runner.model
    assert isinstance(model, DiffusionGemmaModel)
    cfg = model.config
    assert cfg.sliding_window == 16 and any(not s.sliding for s in cfg.layers)
    gen = torch.Generator().manual_seed(0)
    vocab, canvas = cfg.vocab_size, cfg.canvas_length
    prompt = torch.randint(0, vocab, (37,), generator=gen).tolist()
    first = torch.randint(0, vocab, (canvas,), generator=gen).tolist()
    second = torch.randint(0, vocab, (canvas,), generator=gen).tolist()
    sc_logits = torch.randn(1, canvas, vocab, generator=gen) * 3
    kv = runner.pool.reserve(37 + 3 * canvas)
    cache = transformers.DynamicCache(config=ref.config.text_config)
    with torch.no_grad():
        out = ref(
            input_ids=torch.tensor([prompt]), cache=cache, decoder_input_ids=torch.tensor([first])
        )
        enc_ref = softcapped(ref, out.encoder_last_hidden_state)[0]
        dec_ref = out.logits[0]
        dec_sc_ref = ref(cache=cache, decoder_input_ids=torch.tensor([first]),
                         self_conditioning_logits=sc_logits).logits[0]  # fmt: skip
        commit = ref.model.encoder(input_ids=torch.tensor([first]), cache=cache)
        commit_ref = softcapped(ref, commit.last_hidden_state)[0]
        dec2_ref = ref(cache=cache, decoder_input_ids=torch.tensor([second]),
                       self_conditioning_logits=sc_logits).logits[0]  # fmt: skip
    assert dec_ref.abs().max() > 20  # well into the soft cap's curve
    soft = model.soft_embedding(sc_logits[0].softmax(-1))
    with torch.inference_mode():
        enc = runner.run([RowSpec(prompt, 0, list(range(37)), CAUSAL, kv)]).flat
        kv.length = 37
        dec = runner.run([RowSpec(first, 37, list(range(canvas)), BIDIR, kv)]).flat
        dec_sc = runner.run(
            [RowSpec(first, 37, list(range(canvas)), BIDIR, kv, model_input=soft)]
        ).flat
        committed = runner.run([RowSpec(first, 37, list(range(canvas)), CAUSAL, kv)]).flat
        kv.length = 37 + canvas
        dec2 = runner.run(
            [RowSpec(second, 37 + canvas, list(range(canvas)), BIDIR, kv, model_input=soft)]
        ).flat
    close(enc, enc_ref)
    close(dec, dec_ref)
    close(dec_sc, dec_sc_ref)
    close(committed, commit_ref)
    close(dec2, dec2_ref)


def test_unfused_and_fused_experts_agree(sharp: Path) -> None:
    """The experts before fuse() (checkpoint layout, one by one) and after it (stacked, the
    grouped path) give the same logits."""
    loaded = load_model(str(sharp), dtype="float32")
    model = loaded.model
    assert isinstance(model, DiffusionGemmaModel)
    rows = [RowSpec(list(range(5, 30)), 0, list(range(25)), CAUSAL, None)]
    batch, _ = BatchPacker(torch.device("cpu"), None, row_inputs=True).build(rows)
    with torch.inference_mode():
        before = model.lm_head(model.forward_flat(batch))
        model.fuse_projections()
        after = model.lm_head(model.forward_flat(batch))
    torch.testing.assert_close(after, before, rtol=0, atol=1e-4)


def test_a_decoder_pass_leaves_the_committed_cache_alone(sharp: Path) -> None:
    """A decoder pass only writes the canvas' own (uncommitted) slots: the prefix's K/V are
    bit for bit what the encoder wrote."""
    runner = ours(sharp)
    canvas = runner.model.config.canvas_length
    kv = runner.pool.reserve(20 + canvas)
    with torch.inference_mode():
        runner.run([RowSpec(list(range(3, 23)), 0, [19], CAUSAL, kv)])
        kv.length = 20
        slots = torch.tensor(kv.slots(0, 20))
        before = runner.pool.k[:, slots].clone(), runner.pool.v[:, slots].clone()
        runner.run([RowSpec(list(range(canvas)), 20, [0], BIDIR, kv)])
    assert torch.equal(runner.pool.k[:, slots], before[0])
    assert torch.equal(runner.pool.v[:, slots], before[1])


def test_mixed_forward_equals_separate_forwards(sharp: Path) -> None:
    """An encoder row (a prompt) and a decoder row (another request's canvas with its
    self-conditioning) in one forward give each row's logits of its own forward."""
    runner = ours(sharp)
    model = runner.model
    canvas, vocab = model.config.canvas_length, model.config.vocab_size
    gen = torch.Generator().manual_seed(5)
    a_prompt = torch.randint(0, vocab, (21,), generator=gen).tolist()
    b_prompt = torch.randint(0, vocab, (9,), generator=gen).tolist()
    a_canvas = torch.randint(0, vocab, (canvas,), generator=gen).tolist()
    soft = model.soft_embedding(torch.randn(canvas, vocab, generator=gen).softmax(-1))
    with torch.inference_mode():
        a, b = runner.pool.reserve(21 + canvas), runner.pool.reserve(9 + canvas)
        runner.run([RowSpec(a_prompt, 0, [20], CAUSAL, a)])
        a.length = 21
        a_row = RowSpec(a_canvas, 21, list(range(canvas)), BIDIR, a, model_input=soft)
        b_row = RowSpec(b_prompt, 0, list(range(9)), CAUSAL, b)
        both = runner.run([b_row, a_row])
        a_alone = runner.run([a_row]).flat
        b2 = runner.pool.reserve(9 + canvas)
        b_alone = runner.run([RowSpec(b_prompt, 0, list(range(9)), CAUSAL, b2)]).flat
    torch.testing.assert_close(both.row(1), a_alone, rtol=0, atol=1e-4)  # fp32 rounding
    torch.testing.assert_close(both.row(0), b_alone, rtol=0, atol=1e-4)
