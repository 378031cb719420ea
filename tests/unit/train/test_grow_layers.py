"""``--grow-layers``: a trained checkpoint continued with more layers computes exactly what it
computed before training resumes, and the flag is refused where it cannot mean that."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest
import torch

from dllm_serve.models.loader import load_model
from dllm_serve.models.transformer import DecoderTransformer
from dllm_serve_train.__main__ import main
from dllm_serve_train.loop import grown_state
from dllm_serve_train.skeleton import check_model_files, sizes, write_skeleton

SMALL = ["--d-model", "32", "--mlp", "64", "--steps", "1", "--batch-size", "2"]


@pytest.mark.parametrize(("family", "n_layers"), [("llada", 3), ("llada", 5), ("idlm", 4)])
def test_the_grown_model_computes_the_smaller_ones_function(
    tmp_path: Path, family: str, n_layers: int
) -> None:
    write_skeleton(family, tmp_path, 3, 32, sizes(family, 32, 2, 64), 0.0)
    small = load_model(str(tmp_path), device="cpu", dtype="float32").model.eval()
    with torch.no_grad():  # trained-looking output projections (a skeleton's may be tiny)
        for weight in small.parameters():
            weight.add_(0.05 * torch.randn_like(weight))
    grown = grown_state(small.state_dict(), n_layers)
    big = DecoderTransformer(dataclasses.replace(small.config, n_layers=n_layers)).eval()
    big.load_state_dict(grown)  # strict: every tensor of the bigger model is given
    ids = torch.randint(0, small.config.vocab_size - 1, (1, 12))
    positions = torch.arange(12)[None]
    with torch.no_grad():
        want, got = small(ids, positions), big(ids, positions)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Layer j copies layer j * 2 // n_layers; only a repeat has its outputs zeroed.
    sources = [j * 2 // n_layers for j in range(n_layers)]
    for j, source in enumerate(sources):
        repeat = j > 0 and sources[j - 1] == source
        for part in ("attn.q_proj.weight", "attn.o_proj.weight", "mlp.down_proj.weight"):
            copied = small.state_dict()[f"layers.{source}.{part}"]
            if repeat and not part.startswith("attn.q"):
                assert not grown[f"layers.{j}.{part}"].any()
            else:
                assert torch.equal(grown[f"layers.{j}.{part}"], copied)
    assert sum(not (j > 0 and sources[j - 1] == s) for j, s in enumerate(sources)) == 2
    with pytest.raises(ValueError, match="has 2 layers, --n-layers 2"):
        grown_state(small.state_dict(), 2)


def test_grow_layers_is_refused_without_a_smaller_init(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--family", "llada", *SMALL, "--n-layers", "2", "--grow-layers",
              "--out", str(tmp_path / "x")])  # fmt: skip
    assert exit_info.value.code == 2
    assert "--grow-layers needs --init" in capsys.readouterr().err
    write_skeleton("llada", tmp_path / "two", 0, 32, sizes("llada", 32, 2, 64), 0.0)
    for layers in ("2", "1"):
        with pytest.raises(SystemExit):
            main(["--family", "llada", *SMALL, "--n-layers", layers, "--grow-layers",
                  "--init", str(tmp_path / "two"), "--out", str(tmp_path / "y")])  # fmt: skip
        err = capsys.readouterr().err
        assert f"has 2 layers; --n-layers must be more (it is {layers})" in err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    # Another width is still another model, grown or not.
    with pytest.raises(SystemExit):
        main(["--family", "llada", *SMALL, "--mlp", "96", "--n-layers", "3", "--grow-layers",
              "--init", str(tmp_path / "two"), "--out", str(tmp_path / "z")])  # fmt: skip
    assert "this model's is [32, 96]" in capsys.readouterr().err
    # More layers of the same widths pass.
    parser = argparse.ArgumentParser()
    args = argparse.Namespace(
        family="llada", d_model=32, n_layers=3, mlp=64, heads=0, seed=1, canvas=64,
        rope_theta=0.0, block_size=0, init=tmp_path / "two", grow_layers=True,
    )  # fmt: skip
    check_model_files(parser, args, [32])
