"""``python -m dllm_serve_train.transplant --llada DIR --out DIR``: an I-DLM checkpoint (the
SDAR format demo-idlm uses) whose weights start as a trained LLaDA demo's.

Both demos spell text one token per character and load into the same block (RMSNorm,
rotate-half RoPE, SwiGLU), so every LLaDA weight has an I-DLM place under the same internal
name, and token rows are matched by the token's text. What differs, and what the training
that continues it (``python -m dllm_serve_train --family idlm --init OUT`` with the size
flags this prints) has to adapt to:

- the mask: LLaDA reads both ways, an I-DLM is causal;
- SDAR's per-head q/k RMSNorm, which LLaDA has none of: its weights start at the RMS that
  LLaDA's queries and keys have in each layer (mean over a few requests), so attention logits
  start near their old scale rather than at a normalised head's;
- the chat markers: :data:`MARKERS` start from LLaDA's rows of the tokens that play their part,
  the MASK token from LLaDA's MASK.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from dllm_serve.arg_types import new_or_empty_dir
from dllm_serve.models.loader import LoadedModel, load_model
from dllm_serve_train.char_tokens import spell_words_and_numbers
from dllm_serve_train.loop import earlier_stages, save
from dllm_serve_train.skeleton import sizes, write_skeleton

# I-DLM (Qwen) chat markers -> the LLaDA tokens whose rows they start from.
MARKERS = {
    "<|im_start|>": "<|start_header_id|>",
    "<|im_end|>": "<|eot_id|>",
    "<|endoftext|>": "<|startoftext|>",
}
# Requests whose queries and keys set the qk-norm weights (a few of the demos' tasks).
CALIBRATION = (
    "What is 12 + 7?",
    "Reverse the word hello.",
    "Hi, who are you?",
    "spell world backwards",
    "What's 345 plus 678?",
)


def transplant(llada_dir: Path, out: Path, seed: int = 0, canvas: int = 32) -> dict:
    """Writes an I-DLM checkpoint of the LLaDA checkpoint's sizes into ``out``, weights
    transplanted, with a ``training_report.json`` that records this step as a stage of no
    training steps after the LLaDA checkpoint's own stages (so the card of a run continuing
    it lists them); returns the flags that run must repeat."""
    started, cpu_started = time.monotonic(), time.process_time()
    llada = load_model(str(llada_dir), device="cpu", dtype="float32")
    cfg = llada.model.config
    size = sizes(
        "idlm", cfg.d_model, cfg.n_layers, cfg.mlp_hidden_size, cfg.n_heads, cfg.n_kv_heads
    )
    rope_theta = float(json.loads((llada_dir / "config.json").read_text())["rope_theta"])
    write_skeleton("idlm", out, seed, canvas, size, rope_theta)
    spell_words_and_numbers(out)
    idlm = load_model(str(out), device="cpu", dtype="float32")
    ours, theirs = idlm.model.state_dict(), llada.model.state_dict()
    rows = token_rows(idlm, llada)
    with torch.no_grad():
        for name, weight in ours.items():
            if name in ("embed_tokens.weight", "head.weight"):
                for i, j in rows.items():
                    weight[i] = theirs[name][j]
            elif name in theirs:
                weight.copy_(theirs[name])
        for layer, (q_rms, k_rms) in zip(idlm.model.layers, qk_rms(llada), strict=True):
            layer.attn.q_norm.weight.fill_(q_rms)
            layer.attn.k_norm.weight.fill_(k_rms)
    save(idlm.model, idlm, out)
    record = {
        "command": f"python -m dllm_serve_train.transplant --llada {llada_dir} --out {out}"
        + (f" --seed {seed}" if seed else ""),
        "steps": 0,
        "seconds": time.monotonic() - started,
        "cpu_seconds": time.process_time() - cpu_started,
    }
    if earlier := earlier_stages(llada_dir):
        record["init_from"] = earlier
    (out / "training_report.json").write_text(json.dumps(record, indent=2) + "\n")
    return {
        "d_model": cfg.d_model,
        "n_layers": cfg.n_layers,
        "mlp": cfg.mlp_hidden_size,
        "heads": cfg.n_heads,
        "kv_heads": cfg.n_kv_heads,
        "rope_theta": rope_theta,
        "tokens_matched": len(rows),
        "tokens": len(idlm.tokenizer.get_vocab()),
    }


def token_rows(idlm: LoadedModel, llada: LoadedModel) -> dict[int, int]:
    """I-DLM token id -> the LLaDA token id whose embedding and output rows it starts from:
    the same text, a chat marker's counterpart (:data:`MARKERS`), or MASK for MASK. Tokens
    with no counterpart keep the skeleton's random rows."""
    theirs = llada.tokenizer.get_vocab()
    rows = {}
    for text, i in idlm.tokenizer.get_vocab().items():
        j = llada.mask_id if i == idlm.mask_id else theirs.get(MARKERS.get(text, text))
        if j is not None and i < idlm.model.config.vocab_size:
            rows[i] = j
    return rows


def qk_rms(llada: LoadedModel) -> list[tuple[float, float]]:
    """Per layer, the mean RMS of one head's query and of one head's key, over the tokens of
    each :data:`CALIBRATION` request (as LLaDA reads it: both ways), averaged over requests."""
    hd = llada.model.config.head_dim
    sums: list[list[float]] = [[0.0, 0.0] for _ in llada.model.layers]

    def recorder(layer: int, which: int):
        def hook(_module, _inputs, output: torch.Tensor) -> None:
            rms = output.unflatten(-1, (-1, hd)).pow(2).mean(-1).sqrt().mean()
            sums[layer][which] += rms.item() / len(CALIBRATION)

        return hook

    hooks = [
        proj.register_forward_hook(recorder(n, which))
        for n, layer in enumerate(llada.model.layers)
        for which, proj in enumerate((layer.attn.q_proj, layer.attn.k_proj))
    ]
    try:
        with torch.no_grad():
            for request in CALIBRATION:
                prompt = llada.tokenizer.apply_chat_template(
                    [{"role": "user", "content": request}],
                    add_generation_prompt=True,
                    tokenize=False,
                )
                ids = llada.tokenizer(prompt, add_special_tokens=False).input_ids
                llada.model(torch.tensor([ids]), torch.arange(len(ids))[None])
    finally:
        for hook in hooks:
            hook.remove()
    return [(q, k) for q, k in sums]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m dllm_serve_train.transplant", description=__doc__)
    p.add_argument("--llada", type=Path, required=True, help="a trained LLaDA demo checkpoint")
    p.add_argument("--out", type=new_or_empty_dir, required=True)
    p.add_argument("--seed", type=int, default=0, help="the skeleton's (rows with no match)")
    args = p.parse_args(argv)
    if not (args.llada / "model.safetensors").is_file():
        p.error(f"--llada {args.llada}: no model.safetensors there")
    flags = transplant(args.llada, args.out, args.seed)
    print(json.dumps(flags, indent=2))


if __name__ == "__main__":
    main()
