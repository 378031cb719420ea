"""``dllm_serve_train.transplant``: an I-DLM checkpoint started from a LLaDA demo's weights
carries every LLaDA weight in its place, token rows matched by text, qk-norm weights at
LLaDA's measured q/k RMS, and is accepted as ``--init`` by the trainer with the flags it
reports (``--kv-heads`` among them)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from dllm_serve.models.loader import load_model
from dllm_serve_train.__main__ import main
from dllm_serve_train.char_tokens import spell_words_and_numbers
from dllm_serve_train.loop import save
from dllm_serve_train.skeleton import check_model_files, sizes, write_skeleton
from dllm_serve_train.transplant import qk_rms, transplant


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    """A small 'trained' LLaDA (a skeleton with every weight moved off its init) and the
    I-DLM checkpoint transplanted from it."""
    root = tmp_path_factory.mktemp("transplant")
    write_skeleton("llada", root / "llada", 0, 32, sizes("llada", 32, 2, 64, heads=2), 10000.0)
    spell_words_and_numbers(root / "llada")
    llada = load_model(str(root / "llada"), device="cpu", dtype="float32")
    torch.manual_seed(0)
    with torch.no_grad():
        for weight in llada.model.parameters():
            weight.add_(0.3 * torch.randn_like(weight))
    save(llada.model, llada, root / "llada")
    stage = {"command": "python -m dllm_serve_train --family llada", "steps": 7, "seconds": 3.0}
    (root / "llada" / "training_report.json").write_text(json.dumps(stage | {"batch_size": 2}))
    flags = transplant(root / "llada", root / "idlm")
    return root / "llada", root / "idlm", flags


def test_every_llada_weight_is_in_its_place(pair: tuple[Path, Path, dict]) -> None:
    llada_dir, idlm_dir, flags = pair
    assert flags == {
        "d_model": 32, "n_layers": 2, "mlp": 64, "heads": 2, "kv_heads": 2,
        "rope_theta": 10000.0, "tokens_matched": flags["tokens_matched"],
        "tokens": flags["tokens"],
    }  # fmt: skip
    llada = load_model(str(llada_dir), device="cpu", dtype="float32")
    idlm = load_model(str(idlm_dir), device="cpu", dtype="float32")
    assert idlm.family.name != llada.family.name and not idlm.family.bidirectional
    theirs, ours = llada.model.state_dict(), idlm.model.state_dict()
    shared = set(theirs) - {"embed_tokens.weight", "head.weight"}
    assert len(shared) == 1 + 9 * 2  # the final norm; 9 tensors per layer
    for name in shared:
        assert torch.equal(ours[name], theirs[name]), name
    their_vocab, our_vocab = llada.tokenizer.get_vocab(), idlm.tokenizer.get_vocab()
    pairs = [("a", "a"), ("Ġ", "Ġ"), ("7", "7"), ("<|im_end|>", "<|eot_id|>")]
    pairs.append(("<|im_start|>", "<|start_header_id|>"))
    for ours_text, theirs_text in pairs:
        i, j = our_vocab[ours_text], their_vocab[theirs_text]
        for name in ("embed_tokens.weight", "head.weight"):
            assert torch.equal(ours[name][i], theirs[name][j]), (ours_text, name)
    assert torch.equal(ours["head.weight"][idlm.mask_id], theirs["head.weight"][llada.mask_id])
    assert 0.9 * len(our_vocab) < flags["tokens_matched"] <= flags["tokens"] == len(our_vocab)


def test_qk_norm_weights_start_at_llada_s_query_and_key_rms(
    pair: tuple[Path, Path, dict],
) -> None:
    llada_dir, idlm_dir, _ = pair
    measured = qk_rms(load_model(str(llada_dir), device="cpu", dtype="float32"))
    idlm = load_model(str(idlm_dir), device="cpu", dtype="float32")
    for layer, (q_rms, k_rms) in zip(idlm.model.layers, measured, strict=True):
        for norm, rms in ((layer.attn.q_norm, q_rms), (layer.attn.k_norm, k_rms)):
            assert rms > 0.1 and abs(rms - 1.0) > 0.01  # a measurement, not the default 1
            torch.testing.assert_close(
                norm.weight, torch.full_like(norm.weight, rms), rtol=1e-2, atol=0
            )


def test_the_trainer_takes_it_with_the_reported_flags(
    pair: tuple[Path, Path, dict], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, idlm_dir, flags = pair
    args = argparse.Namespace(
        family="idlm", d_model=flags["d_model"], n_layers=flags["n_layers"], mlp=flags["mlp"],
        heads=flags["heads"], kv_heads=flags["kv_heads"], seed=1, canvas=32,
        rope_theta=flags["rope_theta"], block_size=0, init=idlm_dir, grow_layers=False,
    )  # fmt: skip
    check_model_files(argparse.ArgumentParser(), args, [])  # no exit: the shapes match
    small = ["--d-model", "32", "--n-layers", "2", "--mlp", "64", "--heads", "2", "--steps", "1"]
    with pytest.raises(SystemExit) as exit_info:  # without --kv-heads: one KV head, not two
        main(["--family", "idlm", *small, "--init", str(idlm_dir), "--out", str(tmp_path / "a")])
    assert exit_info.value.code == 2
    assert "its weights are not this run's model" in capsys.readouterr().err
    for family, kv, message in [
        ("llada", "2", "--kv-heads: llada has one KV head per attention head"),
        ("idlm", "3", "2 heads are not divisible by 3 KV heads"),
    ]:
        with pytest.raises(SystemExit):
            main(["--family", family, *small, "--kv-heads", kv, "--out", str(tmp_path / "b")])
        assert message in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_transplant_refuses_a_directory_without_weights(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dllm_serve_train.transplant import main as transplant_main

    with pytest.raises(SystemExit) as exit_info:
        transplant_main(["--llada", str(tmp_path), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert "no model.safetensors there" in capsys.readouterr().err


def test_the_transplant_is_recorded_as_a_stage_after_llada_s(
    pair: tuple[Path, Path, dict],
) -> None:
    llada_dir, idlm_dir, _ = pair
    record = json.loads((idlm_dir / "training_report.json").read_text())
    assert record["steps"] == 0 and record["cpu_seconds"] > 0
    assert record["command"] == (
        f"python -m dllm_serve_train.transplant --llada {llada_dir} --out {idlm_dir}"
    )
    # The LLaDA run's own record, without what only describes that run's last stage.
    assert record["init_from"] == {
        "command": "python -m dllm_serve_train --family llada", "steps": 7, "seconds": 3.0,
    }  # fmt: skip
