"""LLaDA2.x (``llada2_moe``): family rules, the tiny checkpoint round trip, and our network
against a straightforward forward written from the spec (``llada2_reference.py``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from llada2_reference import reference_logits
from safetensors.torch import load_file, save_file

from dllm_serve.models.errors import ModelLoadError
from dllm_serve.models.families import LLADA2, UnsupportedModelError, family_for
from dllm_serve.models.layers import Attention
from dllm_serve.models.loader import load_model
from dllm_serve.models.transformer import DecoderTransformer, TransformerConfig
from dllm_serve_train.tiny_checkpoints import main, write_tiny_llada2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llada2(Path(tmp_path_factory.mktemp("l2")) / "tiny-llada2", seed=1)


def config_of(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def copy_with(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    config = {**config_of(src), **changes}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


# ---- dispatch and config rules ---------------------------------------------------------------
def mini_config(tiny: Path) -> dict:
    """The tiny config with LLaDA2.0-mini's real sizes (the writer starts from them)."""
    config = config_of(tiny)
    config.update(
        hidden_size=2048, intermediate_size=5120, num_hidden_layers=20, num_attention_heads=16,
        num_key_value_heads=4, head_dim=128, rotary_dim=64, num_experts=256, n_group=8,
        topk_group=4, num_experts_per_tok=8, moe_intermediate_size=512, vocab_size=157184,
    )  # fmt: skip
    return config


def test_the_real_config_parses(tiny: Path) -> None:
    config = mini_config(tiny)
    assert family_for(config) is LLADA2  # MoE keys, yet not refused: LLaDA2 is implemented
    assert LLADA2.block_diffusion and LLADA2.bidirectional and not LLADA2.logit_shift
    cfg = LLADA2.transformer_config(config)
    assert (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (2048, 16, 4, 128)
    assert cfg.rotary_dim == 64 and cfg.rope_theta == 600000 and cfg.qk_norm and cfg.fused_qkv
    assert not cfg.tie_embeddings and cfg.vocab_size == 157184
    moe = cfg.moe
    assert moe is not None and moe.first_dense_layers == 1 and moe.routed_scaling_factor == 2.5
    assert (moe.num_experts, moe.top_k, moe.n_group, moe.topk_group) == (256, 8, 8, 4)
    assert moe.expert_hidden_size == moe.shared_hidden_size == 512
    assert LLADA2.block_size(config, None) == 32  # the official loop's block
    assert LLADA2.block_size(config, 16) == 16  # generation_config's block_length
    assert LLADA2.block_size({**config, "block_size": 8}, 16) == 8


def test_the_published_mini_metadata_parses() -> None:
    """tests/fixtures/llada2-mini (LLaDA2.0-mini's config, reconstructed; see its README)."""
    real = Path(__file__).resolve().parents[2] / "fixtures" / "llada2-mini"
    config = config_of(real)
    assert family_for(config) is LLADA2
    cfg = LLADA2.transformer_config(config)
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads) == (2048, 20, 16, 4)
    assert cfg.rotary_dim == 64 and cfg.qk_norm and cfg.max_sequence_length == 16384
    assert cfg.moe is not None and cfg.moe.routing == "sigmoid_group_limited"
    assert cfg.moe.renormalize and cfg.moe.first_dense_layers == 1
    gen = json.loads((real / "generation_config.json").read_text())
    assert "block_length" not in gen and LLADA2.block_size(config, None) == 32
    with torch.device("meta"):
        total = sum(p.numel() for p in DecoderTransformer(cfg).parameters())
    assert 16.0e9 < total < 16.5e9  # "16B total"


def test_weight_map_covers_every_parameter_at_real_widths(tiny: Path) -> None:
    config = {**mini_config(tiny), "num_hidden_layers": 3}  # 2 MoE layers keep it quick
    cfg = LLADA2.transformer_config(config)
    with torch.device("meta"):
        params = DecoderTransformer(cfg).state_dict()
    mapping = LLADA2.weight_map(cfg)
    assert sorted(mapping.values()) == sorted(params)
    assert "model.layers.0.mlp.gate_proj.weight" in mapping  # layer 0 dense
    assert "model.layers.1.mlp.experts.255.down_proj.weight" in mapping
    assert params["layers.1.attn.qkv_proj.weight"].shape == ((16 + 2 * 4) * 128, 2048)
    # Per MoE layer: 256 experts × 3 × 2048 × 512, the shared expert, the router and its bias.
    moe_layer = sum(v.numel() for k, v in params.items() if k.startswith("layers.1.mlp."))
    assert moe_layer == 257 * 3 * 2048 * 512 + 256 * 2048 + 256


def test_other_moe_configs_are_still_refused(tiny: Path) -> None:
    config = config_of(tiny)
    for change in ({"model_type": "olmoe"}, {"model_type": "qwen3_moe", "architectures": None}):
        with pytest.raises(UnsupportedModelError, match=r"mixture-of-experts.*llada2_moe"):
            family_for({**config, **change})
    # Relabelled "llada" (LLaDA-MoE's type), its MoE keys make it LLaDA-MoE, whose rules name
    # the LLaDA2 routing key they do not implement instead of loading it as either family.
    for change in ({"model_type": "lladamoe"}, {"model_type": "llada", "num_experts": 64}):
        with pytest.raises(UnsupportedModelError, match="moe_router_enable_expert_bias"):
            family_for({**config, **change})


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"n_group": None}, "'n_group'"),
        ({"routed_scaling_factor": None}, "'routed_scaling_factor'"),
        ({"score_function": "softmax"}, "score_function"),
        ({"moe_router_enable_expert_bias": False}, "moe_router_enable_expert_bias"),
        ({"use_qkv_bias": True}, "use_qkv_bias"),
        ({"norm_head": True}, "norm_head"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rotary_dim": 12}, "rotary_dim 12 disagrees"),
        ({"partial_rotary_factor": 1.5}, "partial_rotary_factor"),
        ({"num_experts": 7}, "multiple of n_group"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
        ({"topk_group": 3}, "topk_group"),
        ({"first_k_dense_replace": 4}, "first_k_dense_replace 4 exceeds"),
        ({"first_k_dense_replace": -1}, "first_k_dense_replace must be a non-negative"),
        ({"num_experts": "8"}, "num_experts must be a positive integer"),
        ({"block_size": 0}, "block_size"),
        ({"rope_scaling": {"rope_type": "longrope"}}, "longrope"),
    ],
)
def test_malformed_configs_refused_naming_the_key(tiny: Path, change: dict, match: str) -> None:
    config = {**config_of(tiny), **change}
    with pytest.raises(UnsupportedModelError, match=match):
        family_for(config).transformer_config(config)


@pytest.mark.parametrize(
    "change",
    [
        {"delete_token_id": 156930, "split_token_id": 156931, "expert_capacity": 48,
         "block_size": 32},
        {"expert_capacity": 48, "block_size": 32},
    ],
)  # fmt: skip
def test_a_llada22_config_parses_with_block_routing(tiny: Path, change: dict) -> None:
    """LLaDA2.2's keys (LLaDA2.2-flash's values): block routing over the checkpoint's block;
    the edit tokens are checked against the vocabulary at load (test_decoding_indel.py)."""
    config = {**config_of(tiny), **change, "num_experts": 256, "num_experts_per_tok": 8,
              "n_group": 8, "topk_group": 4}  # fmt: skip
    moe = family_for(config).transformer_config(config).moe
    assert moe is not None and moe.expert_capacity == 48 and moe.routing_block == 32


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"delete_token_id": 156930}, "delete_token_id alone"),
        ({"expert_capacity": 48}, "without block_size"),
        ({"expert_capacity": 1, "block_size": 32}, "expert_capacity 1 must be in"),
        ({"expert_capacity": "48", "block_size": 32}, "expert_capacity must be a positive"),
    ],
)
def test_an_inconsistent_llada22_config_is_refused(tiny: Path, change: dict, match: str) -> None:
    config = {**config_of(tiny), **change}
    with pytest.raises(UnsupportedModelError, match=match):
        family_for(config).transformer_config(config)


def test_malformed_config_is_a_clear_load_error(tiny: Path, tmp_path: Path) -> None:
    path = copy_with(tiny, tmp_path / "bad", num_experts_per_tok=None)
    with pytest.raises(UnsupportedModelError, match="lacks required key 'num_experts_per_tok'"):
        load_model(str(path))


# ---- make-tiny round trip -----------------------------------------------------------------------
def test_make_tiny_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["--family", "llada2", str(tmp_path / "a"), "--block-size", "4"]) == 0
    out = Path(capsys.readouterr().out.strip())
    config = config_of(out)
    assert config["architectures"] == ["LLaDA2MoeModelLM"] and config["model_type"] == "llada2_moe"
    assert config["partial_rotary_factor"] == 0.5 and config["use_qk_norm"] is True
    assert (config["num_experts"], config["num_experts_per_tok"]) == (8, 2)
    assert (config["n_group"], config["topk_group"], config["num_shared_experts"]) == (2, 1, 1)
    names = set(load_file(str(out / "model.safetensors")))
    assert "model.layers.2.mlp.experts.7.up_proj.weight" in names  # per-expert tensors
    assert "model.layers.1.mlp.gate.expert_bias" in names
    assert "model.layers.0.attention.query_key_value.weight" in names
    loaded = load_model(str(out), dtype="float32")
    assert loaded.family is LLADA2 and loaded.block_size == 4
    tok = loaded.tokenizer
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|mask|>", "<|role_end|>")}
    assert loaded.mask_id == ids["<|mask|>"] and loaded.eos_id == ids["<|endoftext|>"]
    assert loaded.stop_ids == tuple(sorted((ids["<|endoftext|>"], ids["<|role_end|>"])))
    assert loaded.eot_id == ids["<|role_end|>"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert tok.decode(loaded.chat_prompt_ids(messages)) == (
        "<role>SYSTEM</role>Be brief.<|role_end|><role>HUMAN</role>hi<|role_end|>"
        "<role>ASSISTANT</role>"
    )
    # The default block is the official 32 (no block key written); same arguments, same bytes.
    again = write_tiny_llada2(tmp_path / "b", block_size=4)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "model.safetensors"):
        assert (again / name).read_bytes() == (out / name).read_bytes()
    assert load_model(str(write_tiny_llada2(tmp_path / "c")), dtype="float32").block_size == 32


def test_router_stays_fp32_in_a_bf16_model(tiny: Path) -> None:
    model = load_model(str(tiny), dtype="bfloat16").model
    moe = model.layers[1].mlp
    assert moe.router.weight.dtype == moe.router.expert_bias.dtype == torch.float32
    assert moe.experts[0].up_proj.weight.dtype == torch.bfloat16


# ---- q/k norm: on exactly when the checkpoint has the tensors ------------------------------------
def without_norms(tiny: Path, dst: Path, **changes: object) -> Path:
    path = copy_with(tiny, dst, **changes)
    tensors = load_file(str(path / "model.safetensors"))
    norms = ("attention.query_layernorm.weight", "attention.key_layernorm.weight")
    kept = {k: v for k, v in tensors.items() if not k.endswith(norms)}
    assert len(kept) < len(tensors)
    save_file(kept, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def test_qk_norm_follows_the_tensors(tiny: Path, tmp_path: Path) -> None:
    # use_qk_norm false but the tensors present: applied (dFactory applies them always).
    assert load_model(str(copy_with(tiny, tmp_path / "a", use_qk_norm=False))).model.config.qk_norm
    # Neither the flag nor the tensors: off.
    path = without_norms(tiny, tmp_path / "b", use_qk_norm=None)
    assert not load_model(str(path)).model.config.qk_norm
    # The config asks for them and they are missing: named.
    path = without_norms(tiny, tmp_path / "c")
    with pytest.raises(ModelLoadError, match=r"missing.*attention\.query_layernorm"):
        load_model(str(path))


# ---- the network against the spec ---------------------------------------------------------------
def test_partial_rotary_rotates_only_the_first_dims() -> None:
    cfg = TransformerConfig(
        vocab_size=8, d_model=32, n_heads=2, n_kv_heads=2, n_layers=1, mlp_hidden_size=8,
        rope_theta=10000.0, rms_norm_eps=1e-6, tie_embeddings=True, max_sequence_length=64,
        head_dim=16, rotary_dim=8, fused_qkv=True,
    )  # fmt: skip
    model = DecoderTransformer(cfg)
    cos, sin = model.rope(torch.tensor([0, 5, 9]))
    assert cos.shape == (3, 1, 8)
    x = torch.randn(3, 2, 16)
    y = Attention(cfg).rotate(x, cos, sin)
    assert torch.equal(y[..., 8:], x[..., 8:])
    angle = 9 * 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8)  # position 9, dims 0-7
    x1, x2 = x[2, :, :4], x[2, :, 4:8]
    want = torch.cat([x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()], -1)
    torch.testing.assert_close(y[2, :, :8], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("block", [4, 32])
@torch.no_grad()
def test_forward_equals_the_reference_forward(tiny: Path, block: int) -> None:
    """Full canvas, block-causal mask: our padded forward (unfused) and the flat layout
    with fused projections both equal the spec's forward on the checkpoint's own tensors."""
    loaded = load_model(str(tiny), dtype="float32")
    gen = torch.Generator().manual_seed(block)
    tokens = torch.randint(0, loaded.vocab_size - 8, (11,), generator=gen).tolist()
    tokens[7] = loaded.mask_id
    want = reference_logits(tiny, config_of(tiny), tokens, block)
    pos = torch.arange(len(tokens))
    allowed = (pos[None, :] // block) <= (pos[:, None] // block)
    model = loaded.model
    got = model.lm_head(model(torch.tensor([tokens]), pos[None], allowed[None, None]))[0]
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    if block == 4:  # the mask matters: a bidirectional forward differs
        free = model.lm_head(model(torch.tensor([tokens]), pos[None]))[0]
        assert not torch.allclose(free[:4].double(), want[:4], atol=1e-4)
