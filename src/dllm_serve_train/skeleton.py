"""A run's checkpoint skeleton: the model sizes, the random checkpoint in the family's real
format, and the checks that need its files, made before a run writes anything.

The size flags, the canvas and ``--init`` only meet the checkpoint format once its files
exist, so the run's skeleton is first written into a temporary directory and the flags are
checked against it: a canvas longer than the context, or an ``--init`` of another family or
size, is refused before training rather than found by the evaluation afterwards.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from pathlib import Path

from safetensors import safe_open

from dllm_serve.models.families import family_for
from dllm_serve_train.tiny_checkpoints import write_tiny

SIZES = {
    "llada": {"d_model": 192, "n_layers": 6, "n_heads": 6, "mlp_hidden_size": 512},
    "idlm": {"d_model": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "mlp_hidden_size": 384},
    "nemotron": {
        "d_model": 192,
        "n_layers": 4,
        "n_heads": 6,
        "n_kv_heads": 2,
        "mlp_hidden_size": 576,
    },
}


def sizes(
    family: str,
    d_model: int | None,
    n_layers: int | None,
    mlp: int | None,
    heads: int = 0,
    kv_heads: int = 0,
) -> dict:
    """The family's default size, with any overrides (heads of 32 dimensions unless
    ``heads`` is given; I-DLM and tri-mode keep two query heads per KV head unless
    ``kv_heads`` is given; LLaDA has a KV head per head)."""
    out = dict(SIZES[family])
    if d_model:
        out |= {"d_model": d_model, "n_heads": d_model // 32}
    if heads:
        out["n_heads"] = heads
    if d_model or heads:
        if out["d_model"] % out["n_heads"]:
            raise ValueError(f"d_model {out['d_model']} is not divisible by {out['n_heads']} heads")
        if "n_kv_heads" in out:
            out["n_kv_heads"] = max(1, out["n_heads"] // 2)
    if kv_heads:
        if "n_kv_heads" not in out:
            raise ValueError(f"--kv-heads: {family} has one KV head per attention head")
        if out["n_heads"] % kv_heads:
            raise ValueError(f"{out['n_heads']} heads are not divisible by {kv_heads} KV heads")
        out["n_kv_heads"] = kv_heads
    if n_layers:
        out["n_layers"] = n_layers
    if mlp:
        out["mlp_hidden_size"] = mlp
    if family in ("idlm", "nemotron"):
        out["head_dim"] = out["d_model"] // out["n_heads"]
    return out


def write_skeleton(
    family: str,
    out: Path,
    seed: int,
    canvas: int,
    size: dict,
    rope_theta: float,
    block_size: int = 0,
) -> None:
    """A random checkpoint in the family's real format; its generation_config.json carries
    the canvas the model was trained for as ``max_new_tokens`` (the server's default).

    ``rope_theta``: the real checkpoints' 500000 / 1000000 suit head_dim 128 and long
    contexts; with 32-dimensional heads and 60-token rows only 3 or 4 of their 16 rotary
    frequencies turn noticeably, and a bidirectional model (no causal mask to count
    positions with) then barely knows where a token is. 0 keeps the format's value.
    ``block_size`` (tri-mode only, 0: the writer's): the diffusion block and draft length.
    """
    extra = {"block_size": block_size} if family == "nemotron" and block_size else {}
    write_tiny(family, out, seed=seed, **size, **extra)
    without_remote_code(out)
    with_tool_template(out, family)
    if rope_theta:
        config_path = out / "config.json"
        config = json.loads(config_path.read_text())
        # Nemotron keeps it under rope_parameters (YaRN), the others at the top level.
        (config.get("rope_parameters") or config)["rope_theta"] = rope_theta
        config_path.write_text(json.dumps(config, indent=2) + "\n")
    gen_path = out / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    gen["max_new_tokens"] = canvas
    if family == "llada":
        # Served block by block with no masks past the active block, so a long canvas is read
        # as the trained one is and answers do not depend on max_tokens (docs/decoding.md).
        gen["mask_lookahead"] = 0
    gen_path.write_text(json.dumps(gen, indent=2) + "\n")


# Keys that point transformers at a checkpoint's own Python files (not shipped with a demo).
REMOTE_CODE_KEYS = ("auto_map", "trust_remote_code")


def without_remote_code(out: Path) -> None:
    """Drops :data:`REMOTE_CODE_KEYS` from ``config.json`` and ``tokenizer_config.json``.

    The tiny writers copy the real releases' files, ``auto_map`` included, on purpose (the
    server must load such checkpoints without running their code). A demo ships without the
    remote-code files those entries name, and ``AutoTokenizer.from_pretrained(<demo dir>)``
    (what guidellm, aiperf or evalscope do with ``--tokenizer``) would stop at transformers'
    "run custom code? [y/N]" prompt; nothing the server does needs them.
    """
    for name in ("config.json", "tokenizer_config.json"):
        path = out / name
        if not path.is_file():
            continue
        data = json.loads(path.read_text())
        if any(key in data for key in REMOTE_CODE_KEYS):
            kept = {k: v for k, v in data.items() if k not in REMOTE_CODE_KEYS}
            path.write_text(json.dumps(kept, indent=2, ensure_ascii=False) + "\n")


# How each demo format writes one turn, as Jinja expressions of ``role`` and ``text``
# (``first``: the conversation's first turn), and what opens the answer.
_TURNS = {
    "idlm": (
        "'<|im_start|>' + role + '\\n' + text + '<|im_end|>' + '\\n'",
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
    ),
    "llada": (
        "(bos_token if first else '') + '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n'"
        " + text | trim + '<|eot_id|>'",
        "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}",
    ),
    "nemotron": (
        "(bos_token if first else '') + ('[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]'"
        " if role == 'system' else '[INST]' + text + '[/INST]' if role == 'user'"
        " else text + eos_token)",
        "",
    ),
}

# Hermes-style tool instructions (Qwen2.5's wording), which the server's ``hermes`` parser
# reads back: each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
_TOOLS_TEXT = (
    "{%- set ns = namespace(text='# Tools\\n\\nYou may call one or more functions to assist "
    "with the user query.\\n\\nYou are provided with function signatures within <tools>"
    "</tools> XML tags:\\n<tools>') %}"
    "{%- for tool in tools %}{%- set ns.text = ns.text + '\\n' + (tool | tojson) %}{%- endfor %}"
    "{%- set tools_text = ns.text + '\\n</tools>\\n\\nFor each function call, return a json "
    "object with function name and arguments within <tool_call></tool_call> XML tags:\\n"
    '<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n'
    "</tool_call>' %}"
)


def tool_template(format_template: str, family: str) -> str:
    """The demo's chat template: the format's own when a request has no tools (the prompt
    the demo was trained on, byte for byte), and with tools the same turns carrying the
    hermes tool instructions in the system turn, the assistant's earlier calls as
    ``<tool_call>`` blocks and tool results as ``<tool_response>`` user turns.

    The released formats the demos copy render no tools, so a request with ``tool_choice:
    "auto"`` would be refused by the server (the model would never see its tools) and agent
    frameworks, whose later turns are ``auto``, could not run on the demos. The demos were
    not trained on tools: with ``auto`` they answer in text; ``required`` or a named
    function is decoded under the tool's schema by the server.
    """
    turn, answer = _TURNS[family]
    block = (
        "{%- macro turn(role, text, first) %}{{- "
        + turn
        + " }}{%- endmacro %}"
        + _TOOLS_TEXT
        + "{%- if messages and messages[0]['role'] == 'system' %}"
        "{{- turn('system', messages[0]['content'] + '\\n\\n' + tools_text, true) }}"
        "{%- set rest = messages[1:] %}"
        "{%- else %}{{- turn('system', tools_text, true) }}{%- set rest = messages %}{%- endif %}"
        "{%- for message in rest %}"
        "{%- if message['role'] == 'tool' %}"
        "{{- turn('user', '<tool_response>\\n' + message['content'] + '\\n</tool_response>',"
        " false) }}"
        "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
        "{%- set ns = namespace(text=message['content'] or '') %}"
        "{%- for call in message['tool_calls'] %}"
        "{%- set call = call['function'] if call['function'] is defined else call %}"
        "{%- set ns.text = ns.text + ('\\n' if ns.text else '') + '<tool_call>\\n{\"name\": \"'"
        " + call['name'] + '\", \"arguments\": ' + (call['arguments'] | tojson) + '}\\n"
        "</tool_call>' %}"
        "{%- endfor %}"
        "{{- turn('assistant', ns.text, false) }}"
        "{%- else %}{{- turn(message['role'], message['content'], false) }}{%- endif %}"
        "{%- endfor %}" + answer
    )
    return "{%- if tools %}" + block + "{%- else %}" + format_template + "{% endif %}"


def with_tool_template(out: Path, family: str) -> None:
    """Replaces the format's chat template (``chat_template.jinja`` or ``tokenizer_config.json``
    ``chat_template``) with :func:`tool_template`'s."""
    jinja = out / "chat_template.jinja"
    if jinja.is_file():
        jinja.write_text(tool_template(jinja.read_text(), family))
        return
    path = out / "tokenizer_config.json"
    data = json.loads(path.read_text())
    data["chat_template"] = tool_template(data["chat_template"], family)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


# Room kept for the evaluation's templated prompts (the longest is under 100 tokens) and for
# a canvas rounded up to whole blocks.
PROMPT_ROOM = 128


def check_model_files(
    parser: argparse.ArgumentParser, args: argparse.Namespace, canvases: list[int]
) -> None:
    """``parser.error`` (exit 2) unless the sizes make a model, every canvas leaves room for
    a prompt in its context, and ``--init`` holds weights of exactly this model's shapes."""
    try:
        size = sizes(
            args.family,
            args.d_model,
            args.n_layers,
            args.mlp,
            args.heads,
            getattr(args, "kv_heads", 0),
        )
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
            if getattr(args, "grow_layers", False):
                (theirs, n_theirs), (ours, n_ours) = _per_layer(theirs), _per_layer(ours)
                if n_theirs >= n_ours:
                    parser.error(
                        f"--grow-layers: --init {args.init} has {n_theirs} layers; "
                        f"--n-layers must be more (it is {n_ours})"
                    )
            if theirs != ours:
                parser.error(
                    f"--init {args.init}: its weights are not this run's model "
                    f"(--family {args.family} with these size flags): {_difference(theirs, ours)}"
                )


def _shapes(checkpoint: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as weights:
        return {name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}  # noqa: SIM118


def _per_layer(shapes: dict[str, tuple[int, ...]]) -> tuple[dict[str, tuple[int, ...]], int]:
    """The shapes with each layer's index written ``*`` (every layer alike), and the layers."""
    index = re.compile(r"\.(layers|blocks)\.(\d+)\.")
    layers = {int(m.group(2)) for m in map(index.search, shapes) if m}
    return {index.sub(r".\1.*.", k): v for k, v in shapes.items()}, len(layers)


def _difference(theirs: dict[str, tuple[int, ...]], ours: dict[str, tuple[int, ...]]) -> str:
    missing = sorted(set(ours) - set(theirs))
    if missing:
        return f"no tensor {missing[0]!r} ({len(missing)} missing)"
    extra = sorted(set(theirs) - set(ours))
    if extra:
        return f"an unexpected tensor {extra[0]!r} ({len(extra)} extra)"
    name = next(n for n in sorted(ours) if ours[n] != theirs[n])
    return f"{name} is {list(theirs[name])}, this model's is {list(ours[name])}"
