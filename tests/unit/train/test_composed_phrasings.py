"""Reversal requests composed from parts (``composed.py``): many phrasings, none of them, nor
any of their words that only held-out phrasings use, a held-out one's."""

from __future__ import annotations

import itertools
import random
import re

from dllm_serve_train.composed import compose
from dllm_serve_train.composed import too_close as _too_close
from dllm_serve_train.phrasings import PREFIXES, REVERSAL, SUFFIXES
from dllm_serve_train.tasks import examples, is_held_out

HELD_OUT = tuple(t.text for t in REVERSAL if t.split == "held_out")


def too_close(text: str) -> bool:
    return _too_close(text, HELD_OUT)


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z']+", text.lower().replace("{w}", "")))


def _drawn(n: int = 20000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [compose(rng, HELD_OUT) for _ in range(n)]


def test_many_distinct_phrasings_each_with_one_word_slot() -> None:
    drawn = _drawn()
    assert len(set(drawn)) > 8000
    assert all(t.count("{w}") == 1 for t in drawn)
    assert all(t[:1].isupper() or t.startswith("{w}") for t in drawn)
    assert not any(",." in t or ",?" in t or "  " in t for t in drawn)


def test_no_word_that_only_held_out_phrasings_use() -> None:
    trained = set().union(
        *(_words(t.text) for t in REVERSAL if t.split == "train"),
        *(_words(p) for p in (*PREFIXES, *SUFFIXES)),
    )
    held = set().union(*(_words(t.text) for t in REVERSAL if t.split == "held_out"))
    only_held = held - trained
    assert {"look", "say", "type", "give", "following"} <= only_held
    used = set().union(*(_words(t) for t in set(_drawn())))
    assert not used & only_held


def test_no_phrasing_shares_four_words_with_a_held_out_one() -> None:
    assert all(too_close(t) for t in HELD_OUT)
    assert too_close("How would you write {w} backwards?")  # "you write {w} backwards"
    assert too_close("Please say {w} backwards now.")  # holds "Say {w} backwards." whole
    assert not too_close("Spell {w} backwards.") and not too_close("Reverse the word {w}.")
    assert not any(too_close(t) for t in set(_drawn()))


def test_training_stream_mixes_composed_and_written_phrasings() -> None:
    def reversals(composed: float) -> list:
        stream = examples(5, "train", tasks=("reverse_word",), weights={"reverse_word": 1},
                          phrasing=1.0, composed=composed)  # fmt: skip
        return list(itertools.islice(stream, 3000))

    written = {t.text for t in REVERSAL if t.split == "train"}
    assert {e.template for e in reversals(0.0)} <= written  # off by default
    mixed = reversals(0.5)
    made = [e for e in mixed if e.template not in written]
    assert 0.4 < len(made) / len(mixed) < 0.6 and len({e.template for e in made}) > 1000
    for ex in made:
        assert not is_held_out(ex.key) and not too_close(ex.template)
        word = ex.answer[::-1]  # the answer reverses the word the question names
        assert re.search(rf"(^|[\s'\"]){re.escape(word)}([\s'\".,;:?!]|$)", ex.question), ex
