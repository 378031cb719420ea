"""Family rules checked against the real LLaDA-8B-Instruct metadata files (no weights)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dllm_serve.models.families import LLADA, UnsupportedModelError, family_for
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
def test_moe_rejected(real_config: dict, change: dict) -> None:
    with pytest.raises(UnsupportedModelError, match="mixture-of-experts"):
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
