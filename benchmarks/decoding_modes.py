"""Forward passes (NFE) per answer token for each decoding mode.

    python benchmarks/decoding_modes.py            # tiny-llada on CPU, writes JSON
    python benchmarks/decoding_modes.py --model /models/LLaDA-8B-Instruct --device cuda

Runs every prompt alone through ``LLaDADenoiser`` exactly as the engine does (prepare →
batched forward → logits at ``logits_index`` → update), greedy, with the model's stop ids (so the
exact EOS early stop is included), and writes ``benchmarks/results/decoding_modes.json``.
With the embedded ``tiny-llada`` (random weights) the model is never confident, so the
numbers only show each mode's floor/ceiling; they become meaningful with a trained model.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from dllm_serve.decoding.denoise import LLaDADenoiser
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.engine.batch import build_batch, run_batch
from dllm_serve.models.loader import LoadedModel, load_model

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers.",
    "Translate 'good morning' into German.",
    "Why is the sky blue?",
    "Give me a name for a cat.",
    "What is 12 times 7?",
]
MODES: dict[str, dict] = {
    "uniform": {"block_schedule": "uniform"},
    "cosine": {"block_schedule": "cosine"},
    "front_loaded": {"block_schedule": "front_loaded"},
    "threshold_0.9": {"confidence_threshold": 0.9},
    "local_leap_default": {"use_local_leap": True},
}
RESULTS = Path(__file__).resolve().parent / "results" / "decoding_modes.json"


def run_one(loaded: LoadedModel, denoiser: LLaDADenoiser, ids: list[int], params) -> dict:
    state = denoiser.init_state(ids, params, loaded.device)
    with torch.inference_mode():
        while not state.finished:
            # The engine's own forward path (one-row batch): attention kind and logit
            # positions are honoured exactly as in serving.
            batch = build_batch([denoiser.prepare(state)], pad_id=loaded.mask_id)
            denoiser.update(state, run_batch(loaded.model, batch)[0])
    return {
        "nfe": state.nfe,
        "committed": state.committed,
        "answer_tokens": len(state.answer_tokens()),
        "finish_reason": state.finish_reason,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llada")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--gen-length", type=int, default=64)
    parser.add_argument("--block-length", type=int, default=16)
    parser.add_argument("--steps", type=int, default=32, help="fixed-step modes only")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    loaded = load_model(args.model, device=args.device)
    denoiser = LLaDADenoiser(
        loaded.mask_id,
        loaded.stop_ids,
        logit_shift=loaded.family.logit_shift,
        bidirectional=loaded.family.bidirectional,
    )
    prompts = [loaded.chat_prompt_ids([{"role": "user", "content": p}]) for p in PROMPTS]
    rows = []
    for name, mode in MODES.items():
        params = DecodingParams(
            gen_length=args.gen_length, block_length=args.block_length, steps=args.steps, **mode
        )
        start = time.perf_counter()
        runs = [run_one(loaded, denoiser, ids, params) for ids in prompts]
        seconds = time.perf_counter() - start
        nfe = sum(r["nfe"] for r in runs)
        committed = sum(r["committed"] for r in runs)
        answer = sum(r["answer_tokens"] for r in runs)
        rows.append(
            {
                "mode": name,
                "params": mode,
                "nfe_total": nfe,
                "committed_total": committed,
                "answer_tokens_total": answer,
                "nfe_per_answer_token": round(nfe / answer, 3) if answer else None,
                "nfe_per_canvas_token": round(nfe / committed, 3) if committed else None,
                "tokens_per_forward": round(committed / nfe, 3) if nfe else None,
                "seconds": round(seconds, 3),
                "per_prompt": runs,
            }
        )
        print(
            f"{name:20s} NFE {nfe:5d}  answer tokens {answer:5d}  "
            f"NFE/answer token {rows[-1]['nfe_per_answer_token']}  "
            f"tokens/forward {rows[-1]['tokens_per_forward']}  {seconds:.2f}s"
        )
    report = {
        "model": loaded.name,
        "random_weights": args.model == "tiny-llada",
        "device": str(loaded.device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "gen_length": args.gen_length,
        "block_length": args.block_length,
        "steps_fixed_modes": args.steps,
        "temperature": 0.0,
        "prompts": len(prompts),
        "modes": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
