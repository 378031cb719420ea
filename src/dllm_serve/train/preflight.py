"""Checks that need the model's own files, made before a run writes anything.

The size flags, the canvas and ``--init`` only meet the checkpoint format once its files
exist, so a mistake in them used to surface after training, in the evaluation, with the
run's directory already written (found by QA: ``--canvas 5000`` trained, saved, then failed
on the 2,048-token context; ``--init`` of another family or size failed after the skeleton
was written). Here the run's skeleton is written into a temporary directory first and the
flags are checked against it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from safetensors import safe_open

from dllm_serve.models.families import family_for

# Room kept for the evaluation's templated prompts (the longest is under 100 tokens) and for
# a canvas rounded up to whole blocks.
PROMPT_ROOM = 128


def check_model_files(
    parser: argparse.ArgumentParser, args: argparse.Namespace, canvases: list[int]
) -> None:
    """``parser.error`` (exit 2) unless the sizes make a model, every canvas leaves room for
    a prompt in its context, and ``--init`` holds weights of exactly this model's shapes."""
    from dllm_serve.train.loop import sizes, write_skeleton  # loop imports this package

    try:
        size = sizes(args.family, args.d_model, args.n_layers, args.mlp, args.heads)
    except ValueError as exc:
        parser.error(str(exc))
    with tempfile.TemporaryDirectory() as tmp:
        skeleton = Path(tmp)
        write_skeleton(
            args.family, skeleton, args.seed, args.canvas, size, args.rope_theta, args.block_size
        )
        config = json.loads((skeleton / "config.json").read_text())
        context = family_for(config).transformer_config(config).max_sequence_length
        longest = max([args.canvas, *canvases])
        if longest + PROMPT_ROOM > context:
            flag = "--canvas" if args.canvas == longest else "--eval-canvases"
            parser.error(
                f"{flag}: a canvas of {longest} leaves no room for a prompt in the model's "
                f"context of {context} tokens (at most {context - PROMPT_ROOM})"
            )
        if args.init is not None:
            theirs, ours = _shapes(args.init), _shapes(skeleton)
            if theirs != ours:
                parser.error(
                    f"--init {args.init}: its weights are not this run's model "
                    f"(--family {args.family} with these size flags): {_difference(theirs, ours)}"
                )


def _shapes(checkpoint: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as weights:
        return {name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}  # noqa: SIM118


def _difference(theirs: dict[str, tuple[int, ...]], ours: dict[str, tuple[int, ...]]) -> str:
    missing = sorted(set(ours) - set(theirs))
    if missing:
        return f"no tensor {missing[0]!r} ({len(missing)} missing)"
    extra = sorted(set(theirs) - set(ours))
    if extra:
        return f"an unexpected tensor {extra[0]!r} ({len(extra)} extra)"
    name = next(n for n in sorted(ours) if ours[n] != theirs[n])
    return f"{name} is {list(theirs[name])}, this model's is {list(ours[name])}"
