"""Prefix reuse across requests: the same chat traffic with the prefix cache on and off.

    python benchmarks/prefix_reuse.py --threads 1                     # demo-idlm on CPU
    python benchmarks/prefix_reuse.py --model demo-trimode --users 8 --turns 4
    python benchmarks/prefix_reuse.py --tiny llada2 --ignore-eos       # random block diffusion
    python benchmarks/prefix_reuse.py --model /models/SDAR-4B-Chat --device cuda

The traffic: ``--users`` conversations that share one system prompt of about
``--system-tokens`` tokens, each ``--turns`` turns long; every turn resends the whole
conversation so far (the system prompt, the earlier questions and answers, a new question),
as chat clients do. A turn's requests of all users are submitted at once, staggered by
``--stagger`` seconds (users do not arrive in the same millisecond); the next turn starts when
all of them are answered. The same traffic runs twice in one process on one loaded model —
an engine with ``--enable-prefix-caching`` (the default) and one with
``--no-enable-prefix-caching`` — alternating which goes first over ``--repeat`` rounds.

Reported per setting (the round with the median wall time): prompt tokens, prefill tokens
actually computed (prompt tokens less the cache's hits), all tokens fed to the model, the
cache's hit rate, time to first content (arrival to the first answer token made final:
median and p90 over requests), answer tokens per second (answer tokens / wall time of the
whole traffic) and whether the answers are the same with the cache on and off (greedy: they
must be). ``--ignore-eos`` makes every answer ``--max-tokens`` long (the demos answer an
off-topic question in a few tokens); ``--tiny FAMILY`` serves a tiny random checkpoint of that
family (``make-tiny``) instead of ``--model``. Writes ``benchmarks/results/prefix_reuse.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    RESULTS_DIR,
    add_threads_option,
    apply_threads,
    at_least,
    finite_float,
    machine_info,
    percentile,
    write_json,
)

from dllm_serve.config import EngineConfig
from dllm_serve.decoding.params import DecodingParams
from dllm_serve.engine.engine import AsyncEngine
from dllm_serve.engine.outputs import NullObserver
from dllm_serve.models.loader import LoadedModel, load_model
from dllm_serve_train.tiny_checkpoints import write_tiny

PARAGRAPH = (
    "You are the support assistant of a small bookshop. Answer in one or two short sentences. "
    "Be polite, never invent prices, and if a question is not about books, say so kindly. "
    "Opening hours are nine to six on weekdays and ten to four on Saturdays. "
)
QUESTIONS = [
    "Do you sell second-hand books?",
    "What time do you open on Saturday?",
    "Can I order a book you do not have?",
    "Is there a reading club?",
    "Do you ship abroad?",
    "Can I pay by card?",
    "Do you buy old books?",
    "Where is the shop?",
]


class Counts(NullObserver):
    """Tokens fed to the model and the prefix cache's queries and hits."""

    def __init__(self) -> None:
        self.forward_tokens = 0
        self.queries = 0
        self.hits = 0

    def on_forward(self, rows: int, tokens: int, model_seconds: float, graphed: bool) -> None:
        self.forward_tokens += tokens

    def on_prefix_cache(self, queried: int, hit: int) -> None:
        self.queries += queried
        self.hits += hit


def system_prompt(loaded: LoadedModel, tokens: int) -> str:
    """The paragraph repeated until the system message alone templates to ``tokens``."""
    text = PARAGRAPH
    while len(loaded.chat_prompt_ids([{"role": "system", "content": text}])) < tokens:
        text += PARAGRAPH
    return text


async def one_request(
    engine: AsyncEngine, prompt: list[int], params: DecodingParams, delay: float
) -> dict[str, Any]:
    await asyncio.sleep(delay)
    arrived = time.perf_counter()
    first = None
    text, last = "", None
    async for output in engine.generate(prompt, params):
        if output.delta_text and first is None:
            first = time.perf_counter() - arrived
        text += output.delta_text
        last = output
    assert last is not None and last.finish_reason in ("stop", "length"), last
    return {
        "text": text,
        "ttfc": first,
        "answer_tokens": last.completion_tokens,
        "prompt_tokens": last.prompt_tokens,
        "cached_tokens": last.cached_tokens,
    }


async def traffic(engine: AsyncEngine, args: argparse.Namespace, system: str) -> list[dict]:
    """Every turn of every user's conversation; the per-request results in order."""
    params = DecodingParams(
        gen_length=args.max_tokens, steps=args.max_tokens, ignore_eos=args.ignore_eos
    )
    chats = [[{"role": "system", "content": system}] for _ in range(args.users)]
    results = []
    for turn in range(args.turns):
        prompts = []
        for user, chat in enumerate(chats):
            question = QUESTIONS[(user + turn) % len(QUESTIONS)]
            chat.append({"role": "user", "content": f"(customer {user}) {question}"})
            prompts.append(engine.chat_prompt_ids(chat))
        done = await asyncio.gather(
            *(one_request(engine, p, params, i * args.stagger) for i, p in enumerate(prompts))
        )
        for chat, result in zip(chats, done, strict=True):
            chat.append({"role": "assistant", "content": result["text"]})
            results.append(result | {"turn": turn})
    return results


def run_once(loaded: LoadedModel, args: argparse.Namespace, system: str, on: bool) -> dict:
    counts = Counts()
    config = EngineConfig(enable_prefix_caching=on, max_running_requests=max(args.users, 1))
    engine = AsyncEngine(loaded, config, counts)
    assert (engine.prefix_cache is not None) is on, "the model does not reuse prefixes"
    engine.start()
    try:
        started = time.perf_counter()
        results = asyncio.run(traffic(engine, args, system))
        wall = time.perf_counter() - started
    finally:
        engine.shutdown()
    ttfc = [r["ttfc"] for r in results if r["ttfc"] is not None]
    prompt_tokens = sum(r["prompt_tokens"] for r in results)
    answer_tokens = sum(r["answer_tokens"] for r in results)
    return {
        "prefix_caching": on,
        "requests": len(results),
        "wall_s": round(wall, 3),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": sum(r["cached_tokens"] for r in results),
        "prefill_tokens": prompt_tokens - counts.hits,
        "forward_tokens": counts.forward_tokens,
        "hit_rate": round(counts.hits / counts.queries, 4) if counts.queries else 0.0,
        "ttfc_median_ms": round(1e3 * (percentile(ttfc, 50) or 0), 1),
        "ttfc_p90_ms": round(1e3 * (percentile(ttfc, 90) or 0), 1),
        "answer_tokens": answer_tokens,
        "answer_tokens_per_s": round(answer_tokens / wall, 1),
        "answers": [r["text"] for r in results],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo-idlm", help="(default: %(default)s)")
    p.add_argument("--tiny", metavar="FAMILY", help="a tiny random checkpoint of FAMILY instead")
    p.add_argument("--ignore-eos", action="store_true", help="every answer max-tokens long")
    p.add_argument("--device", default="cpu", help="(default: %(default)s)")
    p.add_argument("--dtype", default="auto", help="(default: %(default)s)")
    p.add_argument("--users", type=at_least(1), default=8, help="(default: %(default)s)")
    p.add_argument("--turns", type=at_least(1), default=4, help="(default: %(default)s)")
    p.add_argument("--system-tokens", type=at_least(1), default=1024,
                   help="(default: %(default)s)")  # fmt: skip
    p.add_argument("--max-tokens", type=at_least(1), default=32, help="(default: %(default)s)")
    p.add_argument(
        "--stagger",
        type=finite_float,
        default=0.02,
        help="seconds between two users' arrivals in a turn (default: %(default)s)",
    )
    p.add_argument("--repeat", type=at_least(1), default=3, help="(default: %(default)s)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "prefix_reuse.json")
    add_threads_option(p)
    args = p.parse_args(argv)
    apply_threads(args.threads)
    if args.tiny:
        args.model = str(write_tiny(args.tiny, Path(tempfile.mkdtemp()) / args.tiny))
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    system = system_prompt(loaded, args.system_tokens)
    shared = len(loaded.chat_prompt_ids([{"role": "system", "content": system}]))
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for r in range(args.repeat):
        for on in (True, False) if r % 2 == 0 else (False, True):
            runs[on].append(run_once(loaded, args, system, on))
    chosen = {on: sorted(rs, key=lambda x: x["wall_s"])[len(rs) // 2] for on, rs in runs.items()}
    same = chosen[True]["answers"] == chosen[False]["answers"]
    report = {
        "benchmark": "prefix_reuse",
        "model": f"tiny-{args.tiny}" if args.tiny else args.model,
        "ignore_eos": args.ignore_eos,
        "users": args.users,
        "turns": args.turns,
        "system_prompt_tokens": shared,
        "max_tokens": args.max_tokens,
        "stagger_s": args.stagger,
        "repeat": args.repeat,
        "same_answers": same,
        "on": {k: v for k, v in chosen[True].items() if k != "answers"},
        "off": {k: v for k, v in chosen[False].items() if k != "answers"},
        "all_wall_s": {key: [x["wall_s"] for x in runs[key == "on"]] for key in ("on", "off")},
        "machine": machine_info(),
    }
    path = write_json(args.out, report)
    keys = ["prompt_tokens", "prefill_tokens", "forward_tokens", "hit_rate", "ttfc_median_ms",
            "ttfc_p90_ms", "answer_tokens_per_s", "wall_s"]  # fmt: skip
    head = f"{report['model']}: {args.users} users x {args.turns} turns"
    print(f"{head}, system prompt {shared} tokens")
    print(f"{'':22}{'cache on':>12}{'cache off':>12}")
    for key in keys:
        print(f"{key:22}{report['on'][key]!s:>12}{report['off'][key]!s:>12}")
    print(f"same answers: {same}; wrote {path}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
