"""DecoderTransformer against transformers' own Llama modules (the LLaDA ≡ Llama equivalence)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dllm_serve.models.loader import load_model
from dllm_serve.models.transformer import DecoderTransformer, TransformerConfig
from dllm_serve_train.tiny_checkpoints import write_tiny_llada

transformers = pytest.importorskip("transformers")

TOL = 1e-4

# LLaDA checkpoint name fragment -> transformers Llama name fragment (checkpoints.md §1.3).
LLADA_TO_LLAMA = {
    "attn_norm": "input_layernorm",
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "attn_out": "self_attn.o_proj",
    "ff_norm": "post_attention_layernorm",
    "ff_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "ff_out": "mlp.down_proj",
}


def llama_name(llada: str) -> str:
    """Independent of families.py, so a wrong map there cannot hide here."""
    fixed = {
        "model.transformer.wte.weight": "model.embed_tokens.weight",
        "model.transformer.ln_f.weight": "model.norm.weight",
        "model.transformer.ff_out.weight": "lm_head.weight",
    }
    if llada in fixed:
        return fixed[llada]
    _, _, _, layer, part, _ = llada.split(".")
    return f"model.layers.{layer}.{LLADA_TO_LLAMA[part]}.weight"


def make_llama(cfg: TransformerConfig) -> torch.nn.Module:
    lcfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.mlp_hidden_size,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        max_position_embeddings=cfg.max_sequence_length,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
    )
    # eager attention: an implementation independent of the SDPA kernel we call ourselves.
    lcfg._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(lcfg).eval()


def float_mask(bool_mask: torch.Tensor) -> torch.Tensor:
    """transformers' 4-D additive mask: 0 where allowed, finfo.min where not."""
    zeros = torch.zeros(bool_mask.shape, dtype=torch.float32)
    return zeros.masked_fill(~bool_mask, torch.finfo(torch.float32).min)


def key_padding_mask(batch: int, length: int, pad_row: int, n_pad: int) -> torch.Tensor:
    """[B,1,L,L] bool: full attention, except row ``pad_row`` cannot see its first n_pad keys."""
    keep = torch.ones(batch, length, dtype=torch.bool)
    keep[pad_row, :n_pad] = False  # left padding, as LLaDA batches are padded
    return keep[:, None, None, :].expand(batch, 1, length, length).clone()


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory):
    path = write_tiny_llada(tmp_path_factory.mktemp("tiny"), seed=3)
    ours = load_model(str(path), dtype="float32")
    llama = make_llama(ours.model.config)
    sd = {llama_name(k): v.float() for k, v in load_file(Path(path) / "model.safetensors").items()}
    llama.load_state_dict(sd, strict=True)
    return ours.model, llama


def inputs(vocab: int, batch: int = 2, length: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, length), generator=g)
    pos = torch.arange(length).expand(batch, length)
    return ids, pos


@torch.no_grad()
def test_matches_llama_bidirectional(tiny_pair) -> None:
    ours, llama = tiny_pair
    ids, pos = inputs(ours.config.vocab_size)
    mine = ours.lm_head(ours(ids, pos))
    full = torch.ones(2, 1, 12, 12, dtype=torch.bool)
    ref = llama(input_ids=ids, position_ids=pos, attention_mask=float_mask(full)).logits
    assert mine.shape == ref.shape == (2, 12, ours.config.vocab_size)
    assert (mine - ref).abs().max().item() <= TOL
    # The comparison has teeth: Llama's own causal mask gives clearly different logits.
    causal = llama(input_ids=ids, position_ids=pos).logits
    assert (mine - causal).abs().max().item() > 100 * TOL


@torch.no_grad()
def test_matches_llama_with_key_padding(tiny_pair) -> None:
    ours, llama = tiny_pair
    ids, pos = inputs(ours.config.vocab_size, seed=1)
    mask = key_padding_mask(2, 12, pad_row=1, n_pad=4)
    mine = ours.lm_head(ours(ids, pos, mask))
    ref = llama(input_ids=ids, position_ids=pos, attention_mask=float_mask(mask)).logits
    assert (mine - ref).abs().max().item() <= TOL
    # Row 0 is unpadded: identical to the unmasked forward.
    unmasked = ours.lm_head(ours(ids, pos))
    assert torch.allclose(mine[0], unmasked[0], atol=1e-6)
    assert not torch.allclose(mine[1], unmasked[1], atol=1e-3)


@torch.no_grad()
def test_gqa_matches_llama() -> None:
    cfg = TransformerConfig(
        vocab_size=96, d_model=48, n_heads=6, n_kv_heads=2, n_layers=2, mlp_hidden_size=80,
        rope_theta=10000.0, rms_norm_eps=1e-6, tie_embeddings=False, max_sequence_length=64,
    )  # fmt: skip
    torch.manual_seed(0)
    ours = DecoderTransformer(cfg).eval()
    for name, p in ours.named_parameters():
        if "norm" in name:  # non-trivial norm weights, so a swapped norm would show
            p.data.uniform_(0.5, 1.5)
    llama = make_llama(cfg)
    to_llama = {
        "embed_tokens": "model.embed_tokens", "norm": "model.norm", "head": "lm_head",
        "attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
        "attn.q_proj": "self_attn.q_proj", "attn.k_proj": "self_attn.k_proj",
        "attn.v_proj": "self_attn.v_proj", "attn.o_proj": "self_attn.o_proj",
        "mlp.gate_proj": "mlp.gate_proj", "mlp.up_proj": "mlp.up_proj",
        "mlp.down_proj": "mlp.down_proj",
    }  # fmt: skip
    sd = {}
    for k, v in ours.state_dict().items():
        stem = k.removesuffix(".weight")
        if stem.startswith("layers."):
            _, i, rest = stem.split(".", 2)
            sd[f"model.layers.{i}.{to_llama[rest]}.weight"] = v
        else:
            sd[f"{to_llama[stem]}.weight"] = v
    llama.load_state_dict(sd, strict=True)
    ids, pos = inputs(cfg.vocab_size, batch=3, length=10, seed=2)
    pos = pos + torch.tensor([[0], [5], [17]])  # rotary positions need not start at 0
    mask = key_padding_mask(3, 10, pad_row=2, n_pad=3)
    mine = ours.lm_head(ours(ids, pos, mask))
    ref = llama(input_ids=ids, position_ids=pos, attention_mask=float_mask(mask)).logits
    assert (mine - ref).abs().max().item() <= TOL


@torch.no_grad()
def test_bidirectional_later_token_changes_position_zero(tiny_pair) -> None:
    ours, _ = tiny_pair
    ids, pos = inputs(ours.config.vocab_size, batch=1)
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % ours.config.vocab_size
    h0, h1 = ours(ids, pos), ours(changed, pos)
    assert not torch.allclose(h0[0, 0], h1[0, 0])


@torch.no_grad()
def test_lm_head_on_subset_equals_slice(tiny_pair) -> None:
    ours, _ = tiny_pair
    ids, pos = inputs(ours.config.vocab_size)
    hidden = ours(ids, pos)
    full = ours.lm_head(hidden)
    rows = torch.tensor([0, 1, 1])
    cols = torch.tensor([3, 0, 11])
    assert torch.allclose(ours.lm_head(hidden[rows, cols]), full[rows, cols], atol=1e-6)
    assert full.shape[-1] == ours.config.vocab_size


@torch.no_grad()
def test_fully_masked_row_does_not_poison_others(tiny_pair) -> None:
    ours, _ = tiny_pair
    ids, pos = inputs(ours.config.vocab_size)
    # Causal attention over a left-padded row: the pad queries see no key at all.
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    mask = causal.expand(2, 1, 12, 12) & key_padding_mask(2, 12, pad_row=1, n_pad=3)
    out = ours(ids, pos, mask)
    assert torch.isfinite(out).all()


@torch.no_grad()
def test_bfloat16_forward_close_to_float32(tiny_pair) -> None:
    ours, _ = tiny_pair
    ids, pos = inputs(ours.config.vocab_size)
    ref = ours.lm_head(ours(ids, pos))
    low = DecoderTransformer(ours.config)
    low.load_state_dict(ours.state_dict())
    low = low.to(torch.bfloat16).eval()
    out = low.lm_head(low(ids, pos))
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max().item() < 0.05


def test_config_rejects_bad_head_split() -> None:
    with pytest.raises(ValueError, match="n_heads"):
        TransformerConfig(
            vocab_size=8, d_model=30, n_heads=4, n_kv_heads=4, n_layers=1, mlp_hidden_size=8,
            rope_theta=1e4, rms_norm_eps=1e-5, tie_embeddings=True, max_sequence_length=8,
        )  # fmt: skip


@torch.no_grad()
def test_kv_prefix_matches_llama_block_mask(tiny_pair) -> None:
    """A block read over a cached prompt == Llama over prompt + block, where the prompt sees
    only itself and the block sees everything (what prefix caching for LLaDA computes). The
    two rows have different prefixes and share one attention call (a ragged group)."""
    import copy

    from dllm_serve.decoding.protocol import RowSpec
    from dllm_serve.engine.model_runner import ModelRunner

    ours, llama = tiny_pair
    runner = ModelRunner(copy.deepcopy(ours), torch.device("cpu"), kv_slots=64)
    assert runner.pool is not None
    prefixes, blocks = [10, 6], [4, 4]
    rows = [inputs(ours.config.vocab_size, 1, p + n, seed=30 + r)[0][0].tolist()
            for r, (p, n) in enumerate(zip(prefixes, blocks, strict=True))]  # fmt: skip
    spans = [runner.pool.reserve(p + n) for p, n in zip(prefixes, blocks, strict=True)]
    for span, p, row in zip(spans, prefixes, rows, strict=True):
        assert span is not None
        runner.run([RowSpec(row[:p], 0, [p - 1], kv=span)])  # the prompt alone: its K/V
        span.length = p
    specs = [RowSpec(row[p:], p, list(range(n)), kv=span)
             for row, p, n, span in zip(rows, prefixes, blocks, spans, strict=True)]  # fmt: skip
    logits = runner.run(specs)
    for r, (p, n) in enumerate(zip(prefixes, blocks, strict=True)):
        mask = torch.ones(1, 1, p + n, p + n, dtype=torch.bool)
        mask[..., :p, p:] = False
        ref = llama(input_ids=torch.tensor(rows[r])[None], position_ids=torch.arange(p + n)[None],
                    attention_mask=float_mask(mask)).logits  # fmt: skip
        assert (logits[r, :n] - ref[0, p:]).abs().max().item() <= TOL
