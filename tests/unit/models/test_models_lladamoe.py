"""LLaDA-MoE (``LLaDAMoEModelLM``): dispatch against the real configs, the config rules, the
tiny checkpoint round trip, and our network against a forward written from the checkpoint's own
modeling code (``lladamoe_reference.py``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from lladamoe_reference import load_tensors, reference_logits
from safetensors.torch import load_file, save_file

from dllm_serve.models.errors import ModelLoadError
from dllm_serve.models.families import LLADA, LLADA2, LLADAMOE, UnsupportedModelError, family_for
from dllm_serve.models.loader import load_model
from dllm_serve.models.transformer import DecoderTransformer
from dllm_serve_train.tiny_checkpoints import main, write_tiny_lladamoe

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
REAL = FIXTURES / "llada-moe-7b-a1b-instruct"


def read(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def real_config() -> dict:
    return read(REAL / "config.json")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_lladamoe(Path(tmp_path_factory.mktemp("lm")) / "tiny-lladamoe", seed=1)


def copy_with(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    (dst / "config.json").write_text(json.dumps({**read(src / "config.json"), **changes}))
    return dst


# ---- dispatch: the real configs ---------------------------------------------------------------
def test_each_real_config_dispatches_to_its_family(real_config: dict) -> None:
    assert family_for(real_config) is LLADAMOE
    assert family_for(read(FIXTURES / "llada2-mini" / "config.json")) is LLADA2
    # LLaDA-8B shares model_type "llada" and stays the dense family.
    assert family_for(read(FIXTURES / "llada-8b-instruct" / "config.json")) is LLADA
    assert real_config["model_type"] == "llada"
    assert LLADAMOE.bidirectional and not LLADAMOE.logit_shift and not LLADAMOE.block_diffusion


def test_the_real_config_parses(real_config: dict) -> None:
    cfg = LLADAMOE.transformer_config(real_config)
    assert (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (2048, 16, 16, 128)
    assert cfg.n_layers == 16 and cfg.vocab_size == 157184 and not cfg.tie_embeddings
    assert cfg.qk_norm and not cfg.fused_qkv and not cfg.qkv_bias and cfg.rotary_dim == 128
    assert cfg.rope_theta == 50000 and cfg.rope_scaling is None and cfg.rms_norm_eps == 1e-5
    moe = cfg.moe
    assert moe is not None and moe.routing == "softmax" and not moe.renormalize
    assert (moe.num_experts, moe.top_k, moe.expert_hidden_size) == (64, 8, 1024)
    assert moe.shared_hidden_size == 0 and moe.routed_scaling_factor == 1.0
    assert all(moe.is_moe_layer(i) for i in range(16))
    assert LLADAMOE.block_size(real_config, 64) is None  # full canvas, not block diffusion


def test_weight_map_covers_every_parameter_at_real_widths(real_config: dict) -> None:
    config = {**real_config, "num_hidden_layers": 2, "moe_layer_freq": [0, 1]}
    config["shared_expert_intermediate_size"] = 2048
    cfg = LLADAMOE.transformer_config(config)
    with torch.device("meta"):
        params = DecoderTransformer(cfg).state_dict()
    mapping = LLADAMOE.weight_map(cfg)
    assert sorted(mapping.values()) == sorted(params)
    assert mapping["model.layers.0.mlp.gate_proj.weight"] == "layers.0.mlp.gate_proj.weight"
    assert mapping["model.layers.1.mlp.gate.weight"] == "layers.1.mlp.router.weight"
    assert (
        mapping["model.layers.1.shared_expert.up_proj.weight"]
        == "layers.1.mlp.shared.up_proj.weight"
    )
    assert "model.layers.1.mlp.experts.63.down_proj.weight" in mapping
    assert params["layers.1.attn.q_norm.weight"].shape == (128,)  # per head, not per projection
    assert params["layers.0.mlp.gate_proj.weight"].shape == (8192, 2048)
    # One MoE layer: 64 experts of 3 × 2048 × 1024, the shared expert, the router (no bias).
    moe_layer = sum(v.numel() for k, v in params.items() if k.startswith("layers.1.mlp."))
    assert moe_layer == 64 * 3 * 2048 * 1024 + 3 * 2048 * 2048 + 64 * 2048


def test_real_sizes_are_the_published_7b_with_1_4b_active(real_config: dict) -> None:
    cfg = LLADAMOE.transformer_config(real_config)
    with torch.device("meta"):
        total = sum(p.numel() for p in DecoderTransformer(cfg).parameters())
    # Per token, 8 of each layer's 64 experts run and the embedding is a lookup: what is left
    # is the model card's "1.4B activated" (a check of the reconstructed sizes).
    idle = 16 * (64 - 8) * 3 * 2048 * 1024
    assert total == 7_356_880_896
    assert total - idle - 157184 * 2048 == 1_397_823_488


@pytest.mark.parametrize(
    "config",
    [
        {"model_type": "llada", "architectures": ["LLaDAMoEModelLM"]},
        {"model_type": "lladamoe"},  # the name third-party loaders rename it to
        {"model_type": None, "architectures": ["LLaDAMoEModelLM"]},
        {"model_type": "llada", "architectures": None},  # the MoE keys alone decide
    ],
)
def test_dispatch_on_the_moe_keys_or_the_architecture(real_config: dict, config: dict) -> None:
    assert family_for({**real_config, **config}) is LLADAMOE


# ---- config rules: every variant the checkpoint's code does not build is refused, by name ------
@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"clip_qkv": 8.0}, "clip_qkv"),
        ({"attention_bias": True}, "attention_bias"),
        ({"moe_router_enable_expert_bias": True}, "moe_router_enable_expert_bias"),
        ({"moe_router_score_function": "sigmoid"}, "moe_router_score_function"),
        ({"norm_topk_prob": True}, "norm_topk_prob"),
        ({"routed_scaling_factor": 2.5}, "routed_scaling_factor"),
        ({"router_num_group": 8}, "router_num_group"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"moe_layer_freq": [1] * 15}, "moe_layer_freq must list"),
        ({"moe_layer_freq": [2] * 16}, "moe_layer_freq must list"),
        ({"moe_layer_freq": None}, "lacks required key 'moe_layer_freq'"),
        ({"moe_layer_freq": [0] + [1] * 15, "dense_intermediate_size": None}, "dense_inter"),
        ({"shared_expert_intermediate_size": -1}, "shared_expert_intermediate_size must be"),
        ({"partial_rotary_factor": -1}, "partial_rotary_factor"),
        ({"partial_rotary_factor": None}, "lacks required key 'partial_rotary_factor'"),
        ({"rope_theta": None}, "lacks required key 'rope_theta'"),
        ({"head_dim": 64}, "head_dim 64 differs"),
        ({"num_experts_per_tok": 65}, "num_experts_per_tok 65"),
        ({"num_experts": "64"}, "num_experts must be a positive integer"),
        ({"expert_intermediate_size": None}, "lacks required key 'expert_intermediate_size'"),
        ({"rope_scaling": {"rope_type": "longrope"}}, "longrope"),
    ],
)
def test_unsupported_variants_refused_naming_the_key(
    real_config: dict, change: dict, match: str
) -> None:
    config = {**real_config, **change}
    with pytest.raises(UnsupportedModelError, match=match):
        family_for(config).transformer_config(config)


def test_rope_keys_may_be_transformers_5_parameters(real_config: dict) -> None:
    config = {
        k: v for k, v in real_config.items() if k not in ("rope_theta", "partial_rotary_factor")
    }
    config["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": 1e4,
        "partial_rotary_factor": 0.25,
    }
    cfg = LLADAMOE.transformer_config(config)
    assert cfg.rope_theta == 1e4 and cfg.rotary_dim == 32


def test_optional_variants_are_built(real_config: dict) -> None:
    config = {**real_config, "moe_layer_freq": [0] * 2 + [1] * 14, "qk_layernorm": False}
    config.update(shared_expert_intermediate_size=512, partial_rotary_factor=0.5)
    config.update(num_key_value_heads=4, tie_word_embeddings=True, router_num_group=1)
    cfg = LLADAMOE.transformer_config(config)
    assert cfg.moe is not None and not cfg.qk_norm and cfg.rotary_dim == 64
    assert [cfg.moe.is_moe_layer(i) for i in range(3)] == [False, False, True]
    assert cfg.moe.shared_hidden_size == 512 and cfg.mlp_hidden_size == 8192
    assert cfg.n_kv_heads == 4 and cfg.tie_embeddings
    assert "lm_head.weight" not in LLADAMOE.weight_map(cfg)


# ---- make-tiny round trip -----------------------------------------------------------------------
SIZE_KEYS = {
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "num_experts", "num_experts_per_tok", "expert_intermediate_size", "dense_intermediate_size",
    "moe_layer_freq", "max_position_embeddings", "vocab_size",
}  # fmt: skip
ID_KEYS = {"eos_token_id", "pad_token_id"}


def test_tiny_config_is_the_real_one_resized(tiny: Path, real_config: dict) -> None:
    config = read(tiny / "config.json")
    assert list(config) == list(real_config)
    assert {k for k in config if config[k] != real_config[k]} <= SIZE_KEYS | ID_KEYS
    gen, real_gen = read(tiny / "generation_config.json"), read(REAL / "generation_config.json")
    assert list(gen) == list(real_gen)
    tok_cfg, real_tok = read(tiny / "tokenizer_config.json"), read(REAL / "tokenizer_config.json")
    for key in ("bos_token", "eos_token", "pad_token", "tokenizer_class", "chat_template"):
        assert tok_cfg[key] == real_tok[key]


def test_make_tiny_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    args = ["--dense-layers", "1", "--n-layers", "3", "--shared-expert-hidden-size", "16"]
    assert main(["--family", "lladamoe", str(tmp_path / "a"), *args]) == 0
    out = Path(capsys.readouterr().out.strip())
    config = read(out / "config.json")
    assert config["architectures"] == ["LLaDAMoEModelLM"] and config["model_type"] == "llada"
    assert config["moe_layer_freq"] == [0, 1, 1] and config["shared_expert_intermediate_size"] == 16
    names = set(load_file(str(out / "model.safetensors")))
    assert "model.layers.0.mlp.down_proj.weight" in names  # the dense layer
    assert "model.layers.2.mlp.experts.7.up_proj.weight" in names  # per-expert tensors
    assert "model.layers.1.shared_expert.gate_proj.weight" in names
    assert "model.layers.1.self_attn.k_norm.weight" in names and "lm_head.weight" in names
    assert not any("expert_bias" in n or "query_key_value" in n for n in names)
    loaded = load_model(str(out), dtype="float32")
    assert loaded.family is LLADAMOE and loaded.block_size is None
    tok = loaded.tokenizer
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|mask|>", "<|role_end|>")}
    # Read from the files: the tiny vocabulary puts them far from the real 156892 / 156895.
    assert loaded.mask_id == ids["<|mask|>"] != 156895
    assert loaded.eos_id == ids["<|endoftext|>"] and loaded.eot_id == ids["<|role_end|>"]
    assert loaded.stop_ids == tuple(sorted((ids["<|endoftext|>"], ids["<|role_end|>"])))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert tok.decode(loaded.chat_prompt_ids(messages)) == (
        "<role>SYSTEM</role>Be brief.<|role_end|><role>HUMAN</role>hi<|role_end|>"
        "<role>ASSISTANT</role>"
    )
    again = write_tiny_lladamoe(
        tmp_path / "b", dense_layers=1, n_layers=3, shared_expert_hidden_size=16
    )
    for name in ("config.json", "generation_config.json", "tokenizer.json", "model.safetensors"):
        assert (again / name).read_bytes() == (out / name).read_bytes()


def test_router_stays_fp32_in_a_bf16_model(tiny: Path) -> None:
    model = load_model(str(tiny), dtype="bfloat16").model
    moe = model.layers[1].mlp
    assert moe.router.weight.dtype == torch.float32 and moe.router.expert_bias is None
    assert moe.experts[0].up_proj.weight.dtype == torch.bfloat16


def test_qk_norm_follows_the_config(tiny: Path, tmp_path: Path) -> None:
    # The checkpoint's code builds the norms only with qk_layernorm; the tensors must agree.
    def without_norms(dst: Path, **changes: object) -> Path:
        path = copy_with(tiny, dst, **changes)
        tensors = load_file(str(path / "model.safetensors"))
        kept = {
            k: v for k, v in tensors.items() if not k.endswith(("q_norm.weight", "k_norm.weight"))
        }
        save_file(kept, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path

    assert not load_model(
        str(without_norms(tmp_path / "a", qk_layernorm=False))
    ).model.config.qk_norm
    with pytest.raises(ModelLoadError, match=r"missing.*self_attn\.q_norm"):
        load_model(str(without_norms(tmp_path / "b")))
    with pytest.raises(ModelLoadError, match=r"unexpected.*self_attn\.k_norm"):
        load_model(str(copy_with(tiny, tmp_path / "c", qk_layernorm=False)))


# ---- the network against the checkpoint's modeling code -----------------------------------------
VARIANTS = {
    "released": {},  # every layer MoE, no shared expert, full RoPE, MHA
    "every-option": {  # a dense layer, a shared expert, partial RoPE, GQA
        "n_layers": 3, "dense_layers": 1, "shared_expert_hidden_size": 24, "rotary_dim": 8,
        "n_kv_heads": 2,
    },
}  # fmt: skip


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint whose norm weights are random too (the writer makes them ones), so a
    swapped or misplaced norm changes the logits."""
    out = write_tiny_lladamoe(
        Path(tmp_path_factory.mktemp("lmv")) / request.param, seed=2, **VARIANTS[request.param]
    )
    tensors = load_file(str(out / "model.safetensors"))
    gen = torch.Generator().manual_seed(7)
    for name, t in tensors.items():
        if name.endswith("norm.weight"):
            tensors[name] = (1 + 0.3 * torch.randn(t.shape, generator=gen)).to(t.dtype)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@torch.no_grad()
def test_forward_equals_the_reference_forward(variant: Path) -> None:
    """Padded forward, unfused and with fused projections, equals the checkpoint code's
    forward on its own tensors to 1e-5 (fp32 against float64)."""
    loaded = load_model(str(variant), dtype="float32")
    config, tensors = read(variant / "config.json"), load_tensors(variant)
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, loaded.vocab_size - 8, (13,), generator=gen).tolist()
    tokens[4] = tokens[9] = loaded.mask_id
    want = reference_logits(tensors, config, tokens)
    model = loaded.model
    ids, pos = torch.tensor([tokens]), torch.arange(len(tokens))[None]
    got = model.lm_head(model(ids, pos))[0]
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    model.fuse_projections()
    fused = model.lm_head(model(ids, pos))[0]
    torch.testing.assert_close(fused.double(), want, rtol=1e-5, atol=1e-5)
    # The test tells apart what LLaDA-MoE is not: OLMoE's projection-wide q/k norm, and
    # renormalised routing weights.
    for other in ({"qk_norm_per_head": False}, {"renormalize": True}):
        wrong = reference_logits(tensors, config, tokens, **other)
        assert not torch.allclose(got.double(), wrong, rtol=1e-4, atol=1e-4), other
