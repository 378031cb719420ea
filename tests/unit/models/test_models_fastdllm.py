"""Fast-dLLM v2 (``Fast_dLLM_Qwen``): dispatch of the real configs (and SDAR's vs I-DLM's),
refused configs, the tiny checkpoint round trip, and our forward against transformers' own
Qwen2 run with an explicit block-causal mask, also through the serving path's KV cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_reference import float_mask, hf_reference, perturb_norms
from safetensors.torch import load_file

from dllm_serve.decoding.protocol import AttentionKind, RowSpec
from dllm_serve.engine.model_runner import ModelRunner
from dllm_serve.models.families import (
    FAST_DLLM,
    SDAR,
    SDAR_BLOCK,
    UnsupportedModelError,
    family_for,
)
from dllm_serve.models.loader import load_model
from dllm_serve.models.transformer import DecoderTransformer
from dllm_serve_train.tiny_checkpoints import main, write_tiny_fastdllm

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
TOL = 1e-5


def real(name: str, file: str = "config.json") -> dict:
    return json.loads((FIXTURES / name / file).read_text())


# ---- dispatch of the published configs ---------------------------------------------------------
def test_real_configs_dispatch_to_their_families() -> None:
    fast, sdar, idlm = real("fast-dllm-v2-7b"), real("sdar-4b-chat"), real("idlm-8b")
    assert family_for(fast) is FAST_DLLM and FAST_DLLM.block_size(fast, None) == 32
    assert FAST_DLLM.block_diffusion and FAST_DLLM.logit_shift and FAST_DLLM.sub_block_size == 8
    # SDAR and I-DLM: the same model_type, block_size and no use_regular_causal in either.
    assert family_for(sdar) is SDAR_BLOCK and SDAR_BLOCK.block_size(sdar, None) == 4
    assert family_for(idlm) is SDAR
    assert {k for k in ("block_size", "use_regular_causal") if k in sdar} == {"block_size"}
    assert {k for k in ("block_size", "use_regular_causal") if k in idlm} == {"block_size"}
    # The explicit key decides over SDAR's release keys.
    assert family_for({**sdar, "use_regular_causal": True}) is SDAR
    assert family_for({**idlm, "use_regular_causal": False}) is SDAR_BLOCK
    assert family_for({**idlm, "ep_size": 1}) is SDAR_BLOCK


def test_real_fastdllm_config_and_weight_index() -> None:
    config = real("fast-dllm-v2-7b")
    cfg = FAST_DLLM.transformer_config(config)
    assert (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (3584, 28, 4, 128)
    assert (cfg.n_layers, cfg.mlp_hidden_size, cfg.vocab_size) == (28, 18944, 152064)
    assert cfg.qkv_bias and not cfg.o_bias and not cfg.qk_norm and not cfg.tie_embeddings
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling is None and cfg.rms_norm_eps == 1e-6
    index = real("fast-dllm-v2-7b", "model.safetensors.index.json")
    expected = FAST_DLLM.weight_map(cfg)
    assert set(index["weight_map"]) == set(expected)
    with torch.device("meta"):
        params = DecoderTransformer(cfg).state_dict()
    assert sorted(expected.values()) == sorted(params)
    assert sum(p.numel() for p in params.values()) * 2 == index["metadata"]["total_size"]  # bf16
    # The tokenizer files: the mask the family names, the stops it expects.
    added = real("fast-dllm-v2-7b", "added_tokens.json")
    assert added[FAST_DLLM.mask_token] == 151665
    assert (added["<|im_end|>"], added["<|endoftext|>"]) == (151645, 151643)
    assert real("fast-dllm-v2-7b", "generation_config.json")["eos_token_id"] == [151645, 151643]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"model_type": "sdar"}, "ambiguous.*bd_size"),  # SDAR/I-DLM would ignore the block
        ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}, "bd_size.*qwen2"),
        ({"block_size": 4}, "ambiguous.*block_size"),
        ({"use_regular_causal": False}, "ambiguous.*use_regular_causal"),
        ({"bd_size": 12}, "multiple of the sub-block"),
        ({"bd_size": 0}, "positive integer"),
        ({"use_sliding_window": True}, "use_sliding_window"),
    ],
)
def test_ambiguous_and_unsupported_configs_refused(change: dict, match: str) -> None:
    config = {**real("fast-dllm-v2-7b"), **change}
    with pytest.raises(UnsupportedModelError, match=match):
        family_for(config).transformer_config(config)


def test_an_absent_bd_size_is_the_config_class_default() -> None:
    config = {k: v for k, v in real("fast-dllm-v2-7b").items() if k != "bd_size"}
    assert family_for(config) is FAST_DLLM and FAST_DLLM.block_size(config, None) == 32
    assert FAST_DLLM.block_size({**config, "bd_size": 64}, 16) == 64  # not generation_config's


# ---- make-tiny ---------------------------------------------------------------------------------
SIZES = {
    "hidden_size", "intermediate_size", "num_hidden_layers", "max_window_layers", "layer_types",
    "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "vocab_size",
    "bd_size",
}  # fmt: skip
IDS = {"bos_token_id", "eos_token_id", "pad_token_id"}


def test_make_tiny_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["--family", "fastdllm", str(tmp_path / "a"), "--block-size", "16"]) == 0
    out = Path(capsys.readouterr().out.strip())
    config, want = json.loads((out / "config.json").read_text()), real("fast-dllm-v2-7b")
    assert list(config) == list(want)  # the real keys, in the real order
    assert {k for k in want if want[k] != config[k]} <= SIZES | IDS
    assert config["bd_size"] == 16 and config["layer_types"] == ["full_attention"] * 2
    for name in ("special_tokens_map.json", "chat_template.jinja"):
        assert (out / name).read_text() == (FIXTURES / "fast-dllm-v2-7b" / name).read_text()
    names = set(load_file(str(out / "model.safetensors")))
    assert "model.layers.1.self_attn.q_proj.bias" in names  # Qwen2: q/k/v biases
    assert "model.layers.1.self_attn.o_proj.bias" not in names and "lm_head.weight" in names
    loaded = load_model(str(out), dtype="float32")
    assert loaded.family is FAST_DLLM and loaded.block_size == 16
    tok = loaded.tokenizer
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("|<MASK>|", "<|im_end|>", "<|endoftext|>")}
    assert loaded.mask_id == ids["|<MASK>|"] and loaded.eos_id == loaded.eot_id == ids["<|im_end|>"]
    assert loaded.stop_ids == tuple(sorted((ids["<|im_end|>"], ids["<|endoftext|>"])))
    messages = [{"role": "user", "content": "hi"}]
    assert tok.decode(loaded.chat_prompt_ids(messages)) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    again = write_tiny_fastdllm(tmp_path / "b", block_size=16)  # same arguments, same bytes
    for name in ("config.json", "tokenizer_config.json", "vocab.json", "model.safetensors"):
        assert (again / name).read_bytes() == (out / name).read_bytes()
    assert load_model(str(write_tiny_fastdllm(tmp_path / "c"))).block_size == 32


def test_real_ids(tmp_path: Path) -> None:
    loaded = load_model(str(write_tiny_fastdllm(tmp_path / "r", real_ids=True, n_layers=1)))
    assert loaded.vocab_size == 152064 and loaded.mask_id == 151665
    assert (loaded.eos_id, loaded.stop_ids, loaded.pad_id) == (151645, (151643, 151645), 151645)


# ---- the forward against transformers' Qwen2 with the block-causal mask ------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_tiny_fastdllm(tmp_path_factory.mktemp("fd") / "f", block_size=8, seed=5)
    perturb_norms(path)
    return path


def block_causal(n: int, b: int) -> torch.Tensor:
    """[1, 1, n, n] bool: a query in block i sees the keys of blocks ≤ i (blocks of b from 0)."""
    pos = torch.arange(n)
    return ((pos[None, :] // b) <= (pos[:, None] // b))[None, None]


@torch.no_grad()
def test_forward_equals_qwen2_with_a_block_causal_mask(tiny: Path) -> None:
    ours, ref = load_model(str(tiny), dtype="float32").model, hf_reference(tiny)
    ids = torch.randint(
        0, ours.config.vocab_size, (1, 21), generator=torch.Generator().manual_seed(0)
    )
    pos = torch.arange(21)[None]
    mask = block_causal(21, 8)
    mine = ours.lm_head(ours(ids, pos, mask))
    want = ref(input_ids=ids, position_ids=pos, attention_mask=float_mask(mask)).logits
    assert (mine - want).abs().max().item() <= TOL
    # Teeth: Qwen2's own causal attention, and a fully bidirectional one, differ.
    assert (mine - ref(input_ids=ids, position_ids=pos).logits).abs().max().item() > 100 * TOL
    assert (mine - ours.lm_head(ours(ids, pos))).abs().max().item() > 100 * TOL


@torch.no_grad()
def test_serving_path_block_over_its_cached_prefix(tiny: Path) -> None:
    """The decoder's forwards: a block-causal prefill of the prompt's whole blocks kept in the
    KV pool, then one block against it (what each denoising step and each write feeds)."""
    ours, ref = load_model(str(tiny), dtype="float32").model, hf_reference(tiny)
    runner = ModelRunner(ours, torch.device("cpu"), kv_slots=64)
    assert runner.pool is not None
    b, lo = 8, 16
    ids = torch.randint(
        0, ours.config.vocab_size, (lo + b,), generator=torch.Generator().manual_seed(1)
    )
    row = ids.tolist()
    span = runner.pool.reserve(lo + b)
    prefill = RowSpec(row[:lo], 0, list(range(lo)), AttentionKind.BLOCK_CAUSAL, kv=span, block=b)
    first = runner.run([prefill])
    span.length = lo
    block = runner.run([RowSpec(row[lo:], lo, list(range(b)), kv=span)])
    pos = torch.arange(lo + b)[None]
    mask = block_causal(lo + b, b)
    want = ref(input_ids=ids[None], position_ids=pos, attention_mask=float_mask(mask)).logits[0]
    assert (first[0, :lo] - want[:lo]).abs().max().item() <= TOL
    assert (block[0] - want[lo:]).abs().max().item() <= TOL
