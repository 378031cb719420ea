"""RoPE variants against transformers' rotary modules; 4.x and 5.x config spellings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from hf_reference import hf_reference
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from dllm_serve.models.loader import load_model
from dllm_serve.models.rope import RopeConfigError, parse_rope, rope_frequencies, rotary_tables
from dllm_serve_train.tiny_checkpoints import write_tiny_idlm

HEAD_DIM = 64
VARIANTS = {
    "default": ({"rope_type": "default"}, 4096),
    "linear": ({"rope_type": "linear", "factor": 4.0}, 4096),
    "dynamic": ({"rope_type": "dynamic", "factor": 2.0}, 4096),
    "llama3": (
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 1024},
        16384,
    ),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}, 4096),
    "yarn-mscale": (
        {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 512,
         "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
        8192,
    ),
    "yarn-attn-factor": (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
         "attention_factor": 1.25, "truncate": False},
        4096,
    ),
}  # fmt: skip


def hf_tables(params: dict, max_pos: int, positions: torch.Tensor, theta: float):
    cfg = transformers.Qwen3Config(
        hidden_size=HEAD_DIM * 4, num_attention_heads=4, head_dim=HEAD_DIM,
        max_position_embeddings=max_pos, rope_parameters={**params, "rope_theta": theta},
    )  # fmt: skip
    rope = Qwen3RotaryEmbedding(cfg)
    return rope(torch.zeros(1, dtype=torch.float32), positions)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tables_match_transformers(variant: str) -> None:
    params, max_pos = VARIANTS[variant]
    theta = 500000.0
    # Positions inside the context (dynamic scaling only starts beyond it), large and small.
    positions = torch.tensor([[0, 1, 7, 100, 1000, 3000, max_pos - 1]])
    got_theta, scaling = parse_rope({"rope_parameters": {**params, "rope_theta": theta}}, max_pos)
    assert got_theta == theta
    assert (scaling is None) == (variant == "default")
    inv_freq, factor = rope_frequencies(HEAD_DIM, theta, scaling)
    cos, sin = rotary_tables(positions, inv_freq, factor)
    want_cos, want_sin = hf_tables(params, max_pos, positions, theta)
    assert torch.allclose(cos[:, 0], want_cos, atol=1e-6, rtol=1e-5)
    assert torch.allclose(sin[:, 0], want_sin, atol=1e-6, rtol=1e-5)
    if variant not in ("default", "dynamic"):  # the variant really changes something
        plain = rotary_tables(positions, rope_frequencies(HEAD_DIM, theta, None)[0])[0]
        assert not torch.allclose(cos, plain, atol=1e-3)


def test_v4_and_v5_spellings_agree() -> None:
    v4 = {"rope_theta": 1e6, "rope_scaling": {"type": "yarn", "factor": 4.0,
          "original_max_position_embeddings": 32768}}  # fmt: skip
    v5 = {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
          "original_max_position_embeddings": 32768, "type": "yarn"}}  # fmt: skip
    nested = {"layer_types": ["full_attention"] * 2,
              "rope_parameters": {"full_attention": v5["rope_parameters"]}}  # fmt: skip
    assert parse_rope(v4, 131072) == parse_rope(v5, 131072) == parse_rope(nested, 131072)
    # Found by QA: without layer_types the nested dict was ignored (plain RoPE, no scaling).
    bare = {"rope_parameters": {"full_attention": v5["rope_parameters"]}}
    assert parse_rope(bare, 131072) == parse_rope(v5, 131072)
    assert parse_rope({"rope_theta": 5e5, "rope_scaling": None}, 4096) == (5e5, None)
    assert parse_rope({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, 8) == (
        5e5,
        None,
    )
    assert parse_rope({}, 8) == (10000.0, None)


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"rope_scaling": {"type": "longrope", "short_factor": [1], "long_factor": [1]}},
         "longrope"),
        ({"rope_scaling": {"rope_type": "mrope"}}, "mrope"),
        ({"rope_scaling": {"type": "linear"}}, "factor"),
        ({"rope_scaling": {"type": "llama3", "factor": 8.0}}, "low_freq_factor"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"layer_types": ["a", "b"], "rope_parameters": {"a": {"rope_theta": 1.0},
          "b": {"rope_theta": 2.0}}}, "per-layer"),
        ({"rope_scaling": "yarn"}, "JSON object"),
        ({"rope_parameters": {"full_attention": {"rope_theta": 1.0},
          "sliding_attention": {"rope_theta": 2.0}}}, "per-layer"),  # no layer_types either
        ({"rope_parameters": {"full_attention": {"rope_theta": 1.0}, "factor": 2.0}}, "mix"),
    ],
)  # fmt: skip
def test_unsupported_rope_refused(config: dict, match: str) -> None:
    with pytest.raises(RopeConfigError, match=match):
        parse_rope(config, 4096)


@torch.no_grad()
def test_yarn_checkpoint_matches_qwen3_end_to_end(tmp_path: Path) -> None:
    path = write_tiny_idlm(tmp_path / "yarn", max_sequence_length=512)
    config = json.loads((path / "config.json").read_text())
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    config["rope_scaling"] = yarn
    (path / "config.json").write_text(json.dumps(config))
    ours = load_model(str(path)).model
    assert ours.config.rope_scaling is not None
    ref = hf_reference(path, rope_parameters={**yarn, "rope_type": "yarn", "rope_theta": 1e6})
    ids = torch.randint(
        0, ours.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0)
    )
    pos = torch.arange(300, 309)[None]  # beyond the original context
    mask = torch.ones(9, 9, dtype=torch.bool).tril()[None, None]
    got = ours.lm_head(ours(ids, pos, mask))
    want = ref(input_ids=ids, position_ids=pos).logits
    assert (got - want).abs().max().item() <= 1e-4
