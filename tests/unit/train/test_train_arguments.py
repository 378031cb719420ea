"""The training command refuses bad arguments before writing anything (found by QA: most
were tracebacks from inside the run, after the random skeleton had been written into --out,
over a trained checkpoint when --out held one)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from dllm_serve_train.__main__ import command_line, main
from dllm_serve_train.arguments import parse_canvases, parse_weights
from dllm_serve_train.skeleton import check_model_files, sizes, write_skeleton
from dllm_serve_train.tiny_checkpoints import write_tiny

SMALL = ["--d-model", "32", "--n-layers", "1", "--mlp", "64", "--steps", "1", "--batch-size", "2"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "0"], "--steps must be >= 1"),
        (["--steps", "-3"], "--steps must be >= 1"),
        (["--batch-size", "0"], "--batch-size must be >= 1"),
        (["--d-model", "-32"], "--d-model must be >= 0"),
        (["--canvas", "0"], "--canvas must be >= 1"),
        (["--threads", "-1"], "--threads must be >= 0"),
        (["--addition-weight", "-1"], "--addition-weight must be >= 0"),
        (["--lr", "0"], "--lr must be a finite number > 0"),
        (["--lr", "nan"], "--lr must be a finite number > 0"),
        (["--weights", "reverse_word"], "--weights: 'reverse_word': write TASK=N"),
        (["--weights", "reverse_word=-2"], "--weights: 'reverse_word=-2': write TASK=N"),
        (["--weights", "bogus=1"], "--weights: unknown task 'bogus'"),
        (["--addition-weight", "0", "--weights", "subtraction=0,reverse=0,sort=0,count=0,lookup=0"],
         "every task weight is 0"),
        (["--eval-canvases", "abc"], "--eval-canvases: 'abc' is not a canvas length"),
        (["--device", "cuda:7"], "use cpu, or cuda on a machine with a GPU"),
        (["--device", "banana"], "--device"),
        (["--family", "idlm", "--tail-rows", "2"], "--tail-rows is for --family llada"),
        (["--family", "idlm", "--lora-steps", "2"], "are for --family nemotron"),
        # Found by QA: these trained, saved, then failed in the evaluation (exit 1).
        (["--canvas", "5000"], "--canvas: a canvas of 5000 leaves no room for a prompt in the "
         "model's context of 2048 tokens (at most 1920)"),
        (["--eval-canvases", "32,4096"], "--eval-canvases: a canvas of 4096 leaves no room"),
        (["--heads", "5"], "d_model 32 is not divisible by 5 heads"),
        (["--tail-min-canvas", "64"], "sets the shortest canvas of --tail-rows rows"),
        (["--tail-rows", "2", "--tail-min-canvas", "2000"], "--tail-min-canvas must be <= 1024"),
        (["--composed", "0.5"], "--composed is a share of the phrased reversals: add --phrasing"),
        (["--phrasing", "0.5", "--composed", "2"], "--composed must be between 0 and 1"),
        (["--phrasing", "0.5", "--unfamiliar-verbs", "0.5"],
         "--unfamiliar-verbs is a share of the composed reversals: add --composed"),
        (["--phrasing", "0.5", "--composed", "0.5", "--unfamiliar-verbs", "-1"],
         "--unfamiliar-verbs must be between 0 and 1"),
    ],
)  # fmt: skip
def test_bad_arguments_are_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    family = [] if "--family" in argv else ["--family", "llada"]
    with pytest.raises(SystemExit) as exit_info:
        main([*family, *SMALL, *argv, "--out", str(tmp_path / "x")])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_a_checkpoint_is_never_written_over(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--init X --out X`` replaced X's weights with random ones before failing."""
    trained = tmp_path / "trained"
    trained.mkdir()
    (trained / "model.safetensors").write_bytes(b"weights")
    (trained / "README.md").write_text("card")
    for out in (trained, tmp_path / "file"):
        (tmp_path / "file").write_text("not a directory")
        with pytest.raises(SystemExit) as exit_info:
            main(["--family", "llada", *SMALL, "--init", str(trained), "--out", str(out)])
        assert exit_info.value.code == 2
        assert "exists and is not an empty directory" in capsys.readouterr().err
    assert (trained / "model.safetensors").read_bytes() == b"weights"
    assert sorted(p.name for p in trained.iterdir()) == ["README.md", "model.safetensors"]
    with pytest.raises(SystemExit):
        main(["--family", "llada", *SMALL, "--init", str(tmp_path / "none"), "--out", "y"])
    assert "no model.safetensors there" in capsys.readouterr().err


def test_the_recorded_command_keeps_a_zero_that_is_not_the_default() -> None:
    """Found by QA: ``0 == False``, so ``--addition-weight 0`` was left out of the command."""
    defaults = {"family": None, "addition_weight": 4, "d_model": 0, "spell": False, "lr": 3e-3}
    args = {"family": "llada", "addition_weight": 0, "d_model": 0, "spell": True, "lr": 0.001}
    assert command_line(args, defaults) == (
        "python -m dllm_serve_train --family llada --addition-weight 0 --spell --lr 0.001"
    )


def test_weights_and_canvases_parse() -> None:
    assert parse_weights("reverse_word=4,sort_word=0") == {"reverse_word": 4, "sort_word": 0}
    assert parse_canvases("32, 256,1024") == (32, 256, 1024) and parse_canvases("") == ()
    with pytest.raises(ValueError, match="not a canvas length"):
        parse_canvases("32,0")


def test_init_must_hold_this_runs_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Found by QA: ``--init`` of another family or size failed after the skeleton was
    written into --out (a traceback, exit 1); now exit 2 and nothing written."""
    other_family = tmp_path / "idlm"
    write_tiny("idlm", other_family)
    run = ["--family", "llada", *SMALL, "--init", str(other_family), "--out", str(tmp_path / "x")]
    with pytest.raises(SystemExit) as exit_info:
        main(run)
    assert exit_info.value.code == 2
    assert f"--init {other_family}: its weights are not this run's model" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    # Same family, another size: the first differing tensor is named.
    small = sizes("llada", 32, 1, 64)
    write_skeleton("llada", tmp_path / "small", 0, 32, small, 0.0)
    with pytest.raises(SystemExit):
        main(["--family", "llada", *SMALL, "--mlp", "96", "--init", str(tmp_path / "small"),
              "--out", str(tmp_path / "y")])  # fmt: skip
    assert "ff_out.weight is [32, 64], this model's is [32, 96]" in capsys.readouterr().err
    # The very shapes pass (the checkpoint a first stage of this run would write).
    parser = argparse.ArgumentParser()
    args = argparse.Namespace(
        family="llada", d_model=32, n_layers=1, mlp=64, heads=0, seed=1, canvas=64,
        rope_theta=0.0, block_size=0, init=tmp_path / "small",
    )  # fmt: skip
    check_model_files(parser, args, [32, 256])
