"""The tri-mode demo's training: the dual-stream rows follow the objective (causal clean
stream with next-token targets; a noisy block over the causal prefix predicting its own
masked tokens; nothing sees what it predicts), the trained draft LoRA is what the server
loads, and the whole two-stage run writes a checkpoint, a PEFT adapter and a card."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from dllm_serve.models.loader import LoadedModel, load_model
from dllm_serve.models.lora import attach_draft_lora
from dllm_serve_train.__main__ import main
from dllm_serve_train.draft_lora import TrainableDraftLoRA
from dllm_serve_train.model_card import mode_table
from dllm_serve_train.objectives import encode, loss
from dllm_serve_train.tasks import held_out_set
from dllm_serve_train.tiny_checkpoints import write_tiny
from dllm_serve_train.trimode_objective import block_positions, trimode_batch

BLOCK = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    root = Path(tmp_path_factory.mktemp("nemotron"))
    path = write_tiny("nemotron", root / "tiny", block_size=BLOCK, seed=3)
    return load_model(str(path), device="cpu", dtype="float32")


def test_rows_are_a_causal_clean_stream_and_a_block_over_its_prefix(model: LoadedModel) -> None:
    exs = held_out_set(12)
    batch = trimode_batch(model, exs, random.Random(0), BLOCK, draft_share=0.5)
    blocks = block_positions(batch, BLOCK)
    for row, ex in enumerate(exs):
        prompt, answer = encode(model, ex)
        p, n = len(prompt), len(answer)
        ids, tgt = batch.input_ids[row].tolist(), batch.targets[row].tolist()
        allowed, pos = batch.attn_mask[row, 0], batch.positions[row].tolist()
        assert ids[: p + n] == prompt + answer
        assert blocks[row].nonzero().flatten().tolist() == list(range(p + n, p + n + BLOCK))
        # Clean stream: causal, never sees the block; targets are the next tokens.
        assert torch.equal(allowed[: p + n, : p + n], torch.ones(p + n, p + n).tril().bool())
        assert not allowed[: p + n, p + n :].any()
        assert tgt[p - 1 : p + n - 1] == answer and set(tgt[: p - 1]) == {-100}
        assert tgt[p + n - 1] == -100
        # Block: at the positions of answer[cut:], seeing the prefix left of the cut + itself.
        cut = pos[p + n] - p
        assert pos[p + n : p + n + BLOCK] == list(range(p + cut, p + cut + BLOCK))
        truth = (answer + [model.eos_id] * BLOCK)[cut : cut + BLOCK]
        keys = allowed[p + n : p + n + BLOCK]
        assert keys[:, : p + cut].all() and not keys[:, p + cut : p + n].any()
        assert keys[:, p + n : p + n + BLOCK].all()
        assert ids[p + n] == truth[0] and tgt[p + n] == -100  # the clean seed
        for j in range(1, BLOCK):  # masked ⇔ trained on its own token
            if ids[p + n + j] == model.mask_id:
                assert tgt[p + n + j] == truth[j]
            else:
                assert ids[p + n + j] == truth[j] and tgt[p + n + j] == -100
        # Nothing sees a token it predicts: no query attends to a clean copy of its target.
        for q in range(p + n + BLOCK):
            if tgt[q] != -100 and q >= p + n:
                seen = [ids[k] for k in range(p + n + BLOCK) if allowed[q, k] and pos[k] == pos[q]]
                assert seen == [model.mask_id]


def test_loss_weights_are_the_two_means(model: LoadedModel) -> None:
    batch = trimode_batch(model, held_out_set(10), random.Random(1), BLOCK,
                          ar_weight=1.0, dlm_weight=2.0)  # fmt: skip
    keep = batch.targets != -100
    blocks = block_positions(batch, BLOCK)
    ar, dlm = keep & ~blocks, keep & blocks
    assert batch.normalizer == 1.0
    assert torch.allclose(batch.weights[ar].sum(), torch.tensor(1.0))
    assert torch.allclose(batch.weights[dlm].sum(), torch.tensor(2.0))


def test_draft_share_one_and_the_lora_stage_mask_the_whole_block(model: LoadedModel) -> None:
    for kwargs in ({"draft_share": 1.0}, {"lora_stage": True}):
        batch = trimode_batch(model, held_out_set(8), random.Random(2), BLOCK, **kwargs)
        blocks = block_positions(batch, BLOCK)
        ids = batch.input_ids[blocks].view(8, BLOCK)
        assert (ids[:, 1:] == model.mask_id).all() and (ids[:, 0] != model.mask_id).all()
    keep = batch.targets != -100
    assert (keep <= blocks).all()  # the LoRA stage trains the drafts only


def test_trained_lora_is_what_the_server_applies(model: LoadedModel, tmp_path: Path) -> None:
    """A few LoRA steps change the block's output and only the block's; the saved PEFT files
    load with the serving code and give the same draft outputs (bf16 rounding aside)."""
    net = model.model
    for p in net.parameters():
        p.requires_grad_(False)
    lora = TrainableDraftLoRA(net, rank=4, alpha=16.0, seed=0)
    opt = torch.optim.AdamW(lora.parameters(), lr=1e-2)
    rng = random.Random(0)
    batch = trimode_batch(model, held_out_set(8), rng, BLOCK, lora_stage=True)
    lora.token_mask = block_positions(batch, BLOCK)
    for _ in range(3):
        value = loss(net, batch)
        opt.zero_grad()
        value.backward()
        opt.step()
    with torch.no_grad():
        adapted = net(batch.input_ids, batch.positions, batch.attn_mask)
        lora.token_mask = None
        base = net(batch.input_ids, batch.positions, batch.attn_mask)
    lora.remove()
    blocks = block_positions(batch, BLOCK)
    valid = batch.attn_mask[:, 0].diagonal(dim1=-2, dim2=-1)
    assert torch.equal(adapted[valid & ~blocks], base[valid & ~blocks])  # prefix: base weights
    assert not torch.allclose(adapted[blocks], base[blocks])
    lora.save(tmp_path / "lora", "tiny")
    config = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 16.0, ["o_proj"])
    assert attach_draft_lora(net, tmp_path / "lora") == net.config.n_layers
    # The serving update of every layer is the trained one (PEFT scale alpha / r, bf16 files).
    x = torch.randn(5, net.config.n_heads * net.config.head_dim)
    for i, layer in enumerate(net.layers):
        trained = x @ lora.lora_a[i].T @ lora.lora_b[i].T * lora.scale
        assert torch.allclose(layer.attn.draft_lora(x), trained, atol=1e-2, rtol=1e-2)
        assert trained.abs().max() > 0
        layer.attn.draft_lora = None


def test_mode_table_reports_every_mode_and_the_exactness_count() -> None:
    by_mode = {
        m: {"accuracy": {"addition_1+1": 1.0, "reverse_word": 0.5}, "forwards_per_token": f,
            "tokens_per_forward": 1 / f, "drafted": d, "accepted": a}
        for m, f, d, a in (("ar", 1.0, 0, 0), ("diffusion", 0.5, 0, 0),
                           ("linear_spec", 0.4, 100, 60), ("linear_spec+lora", 0.3, 100, 80))
    }  # fmt: skip
    by_mode["linear_spec"]["same_answers_as_ar"] = 2
    by_mode["linear_spec+lora"]["same_answers_as_ar"] = 2
    by_mode["questions"] = 2
    table = mode_table(by_mode)
    assert "| addition 1+1 | 100.0% | 100.0% | 100.0% | 100.0% |" in table
    assert "| reverse word | 50.0% | 50.0% | 50.0% | 50.0% |" in table
    assert "| drafts accepted | - | - | 60/100 (60.0%) | 80/100 (80.0%) |" in table
    assert "| same answer as `ar` | - | - | 2/2 | 2/2 |" in table


def test_two_stage_run_writes_checkpoint_adapter_and_card(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    main(["--family", "nemotron", "--out", str(out), "--steps", "2", "--batch-size", "4",
          "--d-model", "64", "--n-layers", "1", "--mlp", "64", "--block-size", "8",
          "--lora-steps", "2", "--lora-rank", "2", "--eval-questions", "1",
          "--weights", "subtraction=0,reverse=0,sort=0,count=0,lookup=0"])  # fmt: skip
    report = json.loads((out / "training_report.json").read_text())
    by_mode = report["held_out_by_mode"]
    assert set(by_mode) == {"ar", "diffusion", "linear_spec", "linear_spec+lora", "questions"}
    n = by_mode["questions"]
    assert by_mode["linear_spec"]["same_answers_as_ar"] == n  # exact at T = 0, any weights
    assert by_mode["linear_spec+lora"]["same_answers_as_ar"] == n
    assert json.loads((out / "config.json").read_text())["block_size"] == 8
    assert (out / "draft-lora" / "adapter_model.safetensors").is_file()
    card = (out / "README.md").read_text()
    assert "`linear_spec` + draft LoRA" in card and report["command"] in card
    assert "--lora-steps 2" in report["command"]


def test_block_size_and_lora_flags_are_for_nemotron_only(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["--family", "idlm", "--out", str(tmp_path), "--lora-steps", "3"])
