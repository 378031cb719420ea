"""Do the demos understand how people ask? Held-out phrasings through a real server.

    python benchmarks/demo_phrasings.py                  # the three demos
    python benchmarks/demo_phrasings.py --only idlm --n 50

Each demo is started with the real CLI (``python -m dllm_serve --model demo-…``; the tri-mode
demo with its draft LoRA, in its default ``linear_spec`` mode and again in ``ar``) and asked
through ``/v1/chat/completions`` with the ``openai`` SDK at temperature 0, no other field:

- **held-out phrasings** (``tasks.held_out_phrasings``): additions with operands of 1-3
  digits and reversals of English words, each asked in a template that training never used
  (``phrasings.py``: whole phrasings are held out, not only case or punctuation) about
  content that training never saw; off-topic prompts never trained on (the issue's ``Hi``,
  ``Tell me a joke``, ``Who are you?`` and held-out ones, a third of them of families never
  trained on), which must get the fixed capability reply;
- **context**: every one of those questions again after a held-out system prompt, and after
  one earlier turn (another question of the pool with the model's own answer to it): how
  many answers change;
- **typed by hand**: a short list written before any of these models was trained, of what a
  person might type (``UNPLANNED``), each answer shown;
- **fresh reversal phrasings** (``FRESH_REVERSALS``): the held-out words asked in phrasings
  written after the held-out ones had been studied, which no training choice was made
  against (alone, no context).

Writes ``benchmarks/results/demo_phrasings_<model>.json``.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    RESULTS_DIR,
    add_demo_options,
    at_least,
    demo_families,
    machine_info,
    write_json,
)

from dllm_serve.local_server import LocalServer
from dllm_serve_train.evaluation import by_phrasing, phrasing_sets, score_phrasings
from dllm_serve_train.off_topic import CAPABILITY_REPLY, HELD_OUT_FAMILY
from dllm_serve_train.tasks import Example, is_held_out, words

# The three off-topic prompts, exactly as typed there.
NAMED_OFF_TOPIC = ["Hi", "Tell me a joke", "Who are you?"]
# Written before training, as a person would type them (some match a training template's
# shape; none of their additions is a trained one except where noted by the content split).
UNPLANNED = [
    ("what is 2 + 2", "2 + 2 = 4"),
    ("2+2", "2 + 2 = 4"),
    ("whats 15 plus 27", "15 + 27 = 42"),
    ("123+456=", "123 + 456 = 579"),
    ("can u add 5 and 9", "5 + 9 = 14"),
    ("add 100 and 250 please", "100 + 250 = 350"),
    ("What is 7 + 8 ?", "7 + 8 = 15"),
    ("  What is 250 + 19", "250 + 19 = 269"),
    ("Reverse the word hello", "olleh"),
    ("reverse the word hello.", "olleh"),
    ("reverse hello", "olleh"),
    ("hello backwards", "olleh"),
    ("how would you spell cat backwards", "tac"),
    ("Reverse: banana", "ananab"),
    ("pls reverse dog", "god"),
    ("REVERSE PYTHON", "NOHTYP"),
    ("Hi", CAPABILITY_REPLY),
    ("hello!", CAPABILITY_REPLY),
    ("Tell me a joke", CAPABILITY_REPLY),
    ("Who are you?", CAPABILITY_REPLY),
    ("What's the weather?", CAPABILITY_REPLY),
    ("thanks!", CAPABILITY_REPLY),
    ("What is 5 - 3?", CAPABILITY_REPLY),
    ("What is 6 times 7?", CAPABILITY_REPLY),
    ("Write me a poem about the sea", CAPABILITY_REPLY),
    ("what can you do", CAPABILITY_REPLY),
]
# The held-out reversal phrasings' failures chose what later training added (composed
# phrasings, unfamiliar verbs), so they no longer measure phrasings nobody tuned for. These
# were written on 2026-12-07, before any demo was asked them; none shares a run of four words
# with a training phrasing (test_fresh_reversal_phrasings_are_unlike_every_trained_one).
FRESH_REVERSALS = [
    "Can I get {w} backwards?",
    "Hand me {w}, but reversed.",
    "If you flipped {w}, what would it be?",
    "Reverse-spell {w}.",
    "Put {w} in mirror order.",
    "Backwards please: {w}",
    "Need {w} written backwards.",
    "Switch the letter order of {w}.",
    "Let me see {w} backwards.",
    "{w} but backwards",
    "Do {w} in reverse.",
    "Send {w} back reversed.",
]


def fresh_reversals(n: int) -> list[Example]:
    """``n`` held-out words, each asked in the next of :data:`FRESH_REVERSALS`."""
    rng = random.Random(2026)
    held = [w for w in words() if is_held_out(f"Reverse the word {w}.")]
    out = []
    for i in range(n):
        w, template = rng.choice(held), FRESH_REVERSALS[i % len(FRESH_REVERSALS)]
        out.append(Example("reverse_word", template.replace("{w}", w), w[::-1], template=template))
    return out


def score_fresh(generate, n: int) -> dict[str, Any]:
    """Exact match on :func:`fresh_reversals`, overall and per phrasing."""
    fresh = fresh_reversals(n)
    got = generate([e.messages() for e in fresh])
    rights = [a.strip() == e.answer for a, e in zip(got, fresh, strict=True)]
    right = sum(rights)
    by = by_phrasing(fresh, rights)
    return {"right": right, "of": n, "accuracy": round(right / n, 4), "by_phrasing": by}


def question_sets(n: int) -> dict[str, list[Example]]:
    """The held-out phrasing sets, the off-topic one split into the issue's three, the
    families never trained on and the other held-out prompts."""
    sets = phrasing_sets(n)
    off = sets.pop("off_topic")
    named = [Example("off_topic", q, CAPABILITY_REPLY) for q in NAMED_OFF_TOPIC]
    sets["off_topic_named"] = named
    sets["off_topic_new_families"] = [e for e in off if e.template == HELD_OUT_FAMILY]
    sets["off_topic_held_out"] = [e for e in off if e.template != HELD_OUT_FAMILY]
    return sets


def asker(client: openai.OpenAI, workers: int, extra: dict[str, Any]):
    """Conversations → answer texts, ``workers`` requests at a time."""

    def ask(messages: list[dict[str, str]]) -> str:
        reply = client.chat.completions.create(
            model="demo", messages=messages, temperature=0, **extra
        )
        return reply.choices[0].message.content or ""

    def generate(conversations: list[list[dict[str, str]]]) -> list[str]:
        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(ask, conversations))

    return generate


def measure(generate, n: int) -> dict[str, Any]:
    started = time.monotonic()
    sets = question_sets(n)
    scores = score_phrasings(generate, sets)
    typed = generate([[{"role": "user", "content": q}] for q, _ in UNPLANNED])
    scores["typed_by_hand"] = [
        {"question": q, "expected": want, "answer": got, "right": got.strip() == want}
        for (q, want), got in zip(UNPLANNED, typed, strict=True)
    ]
    scores["typed_by_hand_right"] = sum(row["right"] for row in scores["typed_by_hand"])
    scores["reverse_word_fresh"] = score_fresh(generate, n)
    answers = generate([e.messages() for exs in sets.values() for e in exs[:3]])
    it = iter(answers)
    scores["examples"] = {
        name: [{"question": e.question, "expected": e.answer, "answer": next(it)} for e in exs[:3]]
        for name, exs in sets.items()
    }
    scores["seconds"] = round(time.monotonic() - started, 1)
    return scores


def run_model(family: str, model: str, n: int, workers: int) -> dict[str, Any]:
    args = ["--model", model, "--log-level", "warning"]
    modes: list[tuple[str, dict[str, Any]]] = [("default", {})]
    if family == "trimode":
        lora = "demo-trimode-lora" if model == "demo-trimode" else str(Path(model) / "draft-lora")
        args += ["--draft-lora", lora]
        modes.append(("ar", {"extra_body": {"decoding_mode": "ar"}}))
    log = Path(tempfile.mkdtemp()) / "server.log"
    server = LocalServer.start(args, log)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=600)
    results: dict[str, Any] = {"model": model, "n_per_set": n, "modes": {}}
    try:
        for mode, extra in modes:
            results["modes"][mode] = measure(asker(client, workers, extra), n)
            # The counts of each set; the listed examples and changed answers stay in the file.
            summary = {
                name: {field: value for field, value in score.items() if field != "changed"}
                for name, score in results["modes"][mode].items()
                if isinstance(score, dict) and name != "examples"
            }
            print(model, mode, summary, flush=True)
    finally:
        server.stop()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--n", type=at_least(1), default=200, help="questions per held-out set")
    p.add_argument("--workers", type=at_least(1), default=32, help="concurrent requests")
    add_demo_options(p, ("llada", "idlm", "trimode"))
    args = p.parse_args()
    families = demo_families(p, args, ("llada", "idlm", "trimode"))
    for family in families:
        model = str(args.model_path) if args.model_path else f"demo-{family}"
        result = run_model(family, model, args.n, args.workers)
        result["machine"] = machine_info()
        result["command"] = " ".join(sys.argv)
        write_json(args.out or RESULTS_DIR / f"demo_phrasings_demo-{family}.json", result)


if __name__ == "__main__":
    main()
