"""Family rules checked against the real LLaDA, Dream and I-DLM metadata files (no weights)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dllm_serve.models.families import DREAM, LLADA, SDAR, UnsupportedModelError, family_for
from dllm_serve.models.transformer import DecoderTransformer

REAL = Path(__file__).resolve().parents[2] / "fixtures" / "llada-8b-instruct"


@pytest.fixture
def real_config() -> dict:
    return json.loads((REAL / "config.json").read_text())


def test_real_config_parses(real_config: dict) -> None:
    family = family_for(real_config)
    assert family is LLADA
    assert family.name == "llada" and family.bidirectional and not family.logit_shift
    assert family.mask_token == "<|mdm_mask|>" and family.eot_token == "<|eot_id|>"
    cfg = family.transformer_config(real_config)
    assert cfg.d_model == 4096
    assert cfg.n_heads == cfg.n_kv_heads == 32
    assert cfg.n_layers == 32
    assert cfg.mlp_hidden_size == 12288
    assert cfg.vocab_size == 126464
    assert cfg.rope_theta == 500000.0
    assert cfg.rms_norm_eps == 1e-5
    assert cfg.tie_embeddings is False
    assert cfg.max_sequence_length == 4096
    assert cfg.head_dim == 128


def test_real_index_names_equal_expected(real_config: dict) -> None:
    index = json.loads((REAL / "model.safetensors.index.json").read_text())
    cfg = LLADA.transformer_config(real_config)
    expected = LLADA.weight_map(cfg)
    assert len(index["weight_map"]) == 291
    assert set(index["weight_map"]) == set(expected)


def test_weight_map_covers_every_parameter(real_config: dict) -> None:
    cfg = LLADA.transformer_config(real_config)
    with torch.device("meta"):
        model = DecoderTransformer(cfg)
    params = model.state_dict()
    mapping = LLADA.weight_map(cfg)
    assert sorted(mapping.values()) == sorted(params)
    # 8,015,581,184 parameters, as counted from the real shards' total_size / 2 bytes.
    assert sum(p.numel() for p in params.values()) == 8_015_581_184


def test_unknown_model_type_lists_supported(real_config: dict) -> None:
    with pytest.raises(UnsupportedModelError, match="llada") as e:
        family_for({**real_config, "model_type": "gpt2"})
    assert "gpt2" in str(e.value)
    with pytest.raises(UnsupportedModelError, match="llada"):
        family_for({"d_model": 8})


@pytest.mark.parametrize(
    "change",
    [
        {"architectures": ["LLaDAMoEModelLM"]},
        {"model_type": "lladamoe"},
        {"num_experts": 64, "num_experts_per_tok": 8},
    ],
)
def test_moe_markers_never_load_as_dense_llada(real_config: dict, change: dict) -> None:
    # LLaDA-MoE shares model_type "llada": any MoE marker makes the config LLaDA-MoE's, and
    # LLaDA-8B's keys do not describe that network.
    with pytest.raises(UnsupportedModelError, match=r"LLaDA-MoE config\.json lacks required key"):
        family_for({**real_config, **change})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("block_type", "sequential"),
        ("rope", False),
        ("alibi", True),
        ("layer_norm_type", "default"),
        ("include_qkv_bias", True),
        ("attention_layer_norm", True),
    ],
)
def test_other_architectures_rejected_naming_key(real_config: dict, key: str, value) -> None:
    with pytest.raises(UnsupportedModelError, match=key):
        family_for({**real_config, key: value})


@pytest.mark.parametrize("key", ["block_type", "rope", "alibi", "layer_norm_type"])
def test_missing_architecture_key_rejected(real_config: dict, key: str) -> None:
    # LLaDAConfig's defaults for these keys describe a different (GPT-2-like) network.
    config = {k: v for k, v in real_config.items() if k != key}
    with pytest.raises(UnsupportedModelError, match=key):
        family_for(config)


def test_tied_and_gqa_variants(real_config: dict) -> None:
    config = {**real_config, "weight_tying": True, "n_kv_heads": 8, "mlp_hidden_size": None}
    cfg = LLADA.transformer_config(config)
    assert cfg.tie_embeddings and cfg.n_kv_heads == 8
    assert cfg.mlp_hidden_size == 4 * 4096  # mlp_ratio * d_model when unset
    assert "model.transformer.ff_out.weight" not in LLADA.weight_map(cfg)
    assert LLADA.transformer_config({**real_config, "multi_query_attention": True}).n_kv_heads == 1


# ---- Dream and I-DLM (SDAR) -----------------------------------------------------------------
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
DREAM_REAL = FIXTURES / "dream-v0-instruct-7b"
IDLM_REAL = FIXTURES / "idlm-8b"


def read(path: Path) -> dict:
    return json.loads(path.read_text())


def test_real_dream_config_and_index() -> None:
    config = read(DREAM_REAL / "config.json")
    family = family_for(config)
    assert family is DREAM and family.bidirectional and family.logit_shift
    cfg = family.transformer_config(config)
    assert (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (3584, 28, 4, 128)
    assert (cfg.n_layers, cfg.mlp_hidden_size, cfg.vocab_size) == (28, 18944, 152064)
    assert cfg.qkv_bias and not cfg.o_bias and not cfg.qk_norm and not cfg.tie_embeddings
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling is None and cfg.rms_norm_eps == 1e-6
    index = read(DREAM_REAL / "model.safetensors.index.json")
    expected = DREAM.weight_map(cfg)
    assert set(index["weight_map"]) == set(expected)
    with torch.device("meta"):
        params = DecoderTransformer(cfg).state_dict()
    assert sorted(expected.values()) == sorted(params)
    # total_size / 2 bytes (bf16) = 7,615,616,512 parameters.
    assert sum(p.numel() for p in params.values()) * 2 == index["metadata"]["total_size"]


def test_real_idlm_config_names_equal_qwen3() -> None:
    transformers = pytest.importorskip("transformers")
    config = read(IDLM_REAL / "config.json")
    family = family_for(config)
    assert family is SDAR and not family.bidirectional and family.logit_shift
    cfg = family.transformer_config(config)
    assert (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (4096, 32, 8, 128)
    assert cfg.qk_norm and not cfg.qkv_bias and cfg.max_sequence_length == 40960
    # No weight index of I-DLM-8B was available: the names must be exactly Qwen3's.
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "head_dim",
            "num_attention_heads", "num_key_value_heads", "tie_word_embeddings")  # fmt: skip
    with torch.device("meta"):
        qwen3 = transformers.Qwen3ForCausalLM(
            transformers.Qwen3Config(**{k: config[k] for k in keys})
        )
        ours = DecoderTransformer(cfg)
    assert set(SDAR.weight_map(cfg)) == set(qwen3.state_dict())
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in qwen3.parameters())


def test_idlm_as_plain_qwen3_with_mask_id() -> None:
    config = read(IDLM_REAL / "config.json")
    as_qwen3 = {**config, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
    assert family_for(as_qwen3) is SDAR
    without_mask = {k: v for k, v in as_qwen3.items() if k != "mask_token_id"}
    with pytest.raises(UnsupportedModelError, match=r"plain \(autoregressive\) Qwen3"):
        family_for(without_mask)


@pytest.mark.parametrize(
    ("fixture", "change", "match"),
    [
        ("idlm-8b", {"use_sliding_window": True}, "use_sliding_window"),
        ("idlm-8b", {"architectures": ["SDARMoeForCausalLM"]}, "mixture-of-experts"),
        ("dream-v0-instruct-7b", {"hidden_act": "gelu"}, "hidden_act"),
        ("dream-v0-instruct-7b", {"use_mrope": True}, "use_mrope"),
        ("dream-v0-instruct-7b", {"rope_scaling": {"type": "longrope"}}, "longrope"),
    ],
)
def test_qwen_variants_rejected(fixture: str, change: dict, match: str) -> None:
    config = {**read(FIXTURES / fixture / "config.json"), **change}
    with pytest.raises(UnsupportedModelError, match=match):
        family_for(config).transformer_config(config)


def test_remote_code_only_config_explained() -> None:
    config = {
        "model_type": "mdlm",
        "architectures": ["MDLM"],
        "auto_map": {"AutoConfig": "configuration_mdlm.MDLMConfig"},
    }
    with pytest.raises(UnsupportedModelError, match="remote code") as e:
        family_for(config)
    message = str(e.value)
    assert "trust_remote_code" in message and "mdlm" in message
    assert all(name in message for name in ("llada", "dream", "sdar"))


def test_model_type_decides_over_architectures() -> None:
    config = read(DREAM_REAL / "config.json")
    assert family_for({**config, "model_type": "dream"}) is DREAM  # case-insensitive
    no_type = {k: v for k, v in config.items() if k != "model_type"}
    assert family_for(no_type) is DREAM  # architectures when model_type is absent
