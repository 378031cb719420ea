"""Reversal requests composed from parts (``composed.py``): many phrasings, none of them, nor
any of their words that only held-out phrasings use, a held-out one's."""

from __future__ import annotations

import itertools
import random
import re

from dllm_serve_train import composed
from dllm_serve_train.composed import compose
from dllm_serve_train.composed import too_close as _too_close
from dllm_serve_train.phrasings import PREFIXES, REVERSAL, SUFFIXES
from dllm_serve_train.tasks import examples, is_held_out, trained_words, words

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


def test_unfamiliar_verbs_stand_where_the_verb_goes() -> None:
    rng = random.Random(3)
    made = [compose(rng, HELD_OUT, 1.0, ("give", "zebra")) for _ in range(3000)]
    assert all("zebra" in _words(t) and "give" not in _words(t) for t in made)  # a held-out word
    assert all(t.count("{w}") == 1 and not too_close(t) for t in made)
    assert len(set(made)) > 1000
    assert any(t.startswith("Zebra me ") for t in made) and any(": Zebra it" in t for t in made)
    half = [compose(rng, HELD_OUT, 0.5, ("zebra",)) for _ in range(3000)]
    assert 0.45 < sum("zebra" in _words(t) for t in half) / len(half) < 0.55
    rng, again = random.Random(3), random.Random(3)  # share 0: what compose drew before
    assert [compose(rng, HELD_OUT) for _ in range(300)] == [
        compose(again, HELD_OUT, 0.0, ("zebra",)) for _ in range(300)
    ]


def test_training_stream_with_unfamiliar_verbs_never_uses_the_word_or_a_held_out_one() -> None:
    trained = trained_words()
    assert trained and not any(is_held_out(f"Reverse the word {w}.") for w in trained)
    assert len(trained) > 0.85 * len(words())
    stream = examples(7, "train", tasks=("reverse_word",), weights={"reverse_word": 1},
                      phrasing=1.0, composed=1.0, unfamiliar_verbs=1.0)  # fmt: skip
    written = {t.text for t in REVERSAL if t.split == "train"}
    made = [e for e in itertools.islice(stream, 1500) if e.template not in written]
    assert len(made) > 1000
    held = {w for w in words() if is_held_out(f"Reverse the word {w}.")}
    parts = _words(" ".join(_texts(vars(composed).values())) + " me us this it")
    for ex in made:
        verb = _words(ex.template) - parts  # the words no part of composed.py has
        assert len(verb) <= 1 and verb <= set(trained) and not verb & held, ex
        assert ex.answer[::-1].lower() not in verb, ex  # the verb is another word
        assert not too_close(ex.template), ex
    assert sum(bool(_words(e.template) - parts) for e in made) > 0.8 * len(made)

    # share 0 keeps the stream of a run without the flag
    def first(**shares: float) -> list:
        kw = dict(tasks=("reverse_word",), weights={"reverse_word": 1}, phrasing=1.0)
        return [e.question for e in itertools.islice(examples(7, "train", **kw, **shares), 500)]

    assert first(composed=0.5) == first(composed=0.5, unfamiliar_verbs=0.0)
    assert first(composed=0.5) != first(composed=0.5, unfamiliar_verbs=0.5)


def _texts(values: object) -> list[str]:
    """Every string in ``values`` and the tuples in it."""
    if isinstance(values, str):
        return [values]
    if isinstance(values, (tuple, list, type({}.values()))):
        return [t for v in values for t in _texts(v)]  # type: ignore[union-attr]
    return []


def test_unfamiliar_verbs_without_a_usable_word_are_refused() -> None:
    for verbs in ((), ("give", "look")):  # none, or only words of held-out phrasings
        try:
            compose(random.Random(0), HELD_OUT, 0.5, verbs)
        except ValueError as e:
            assert "no held-out phrasing uses" in str(e)
        else:
            raise AssertionError(f"{verbs} accepted")
