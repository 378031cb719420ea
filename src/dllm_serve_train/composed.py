"""Reversal requests composed from parts: many more phrasings than a hand-written list.

Trained on a few dozen written phrasings, the demos learnt *those* sentences: in an unseen one
they reversed the word next to the cue ("What does skin look like backwards?" -> "ekil").
A request here is a frame (an imperative, a question, a noun phrase, a colon form, the word
first) filled with a verb, the way the word is named, how to reverse it and the filler
people put between them, so that the word to reverse stands at many distances from the cue
and among many other words: more than a hundred thousand distinct phrasings.

Two rules keep the held-out phrasings (``phrasings.REVERSAL``, ``split="held_out"``, which
:func:`compose` is given) unseen, and tests check both:

* no part uses a word that only the held-out phrasings use (``look``, ``say``, ``type``,
  ``give``, ``following`` ...), so a held-out phrasing's wording stays unseen;
* no composed phrasing shares a run of four words (``{w}`` counting as one) with a held-out
  phrasing, nor contains a shorter held-out phrasing whole: :func:`too_close` rejects it
  and :func:`compose` draws again.

Trained on these alone, a demo still took a verb it had never seen for the word ("Give me
{w} reversed." -> the verb reversed): with ``unfamiliar`` a share of the requests have an
arbitrary word of the reversal task as their verb, so that the word to reverse is the one
that stands where the word goes, whatever the other words are.
"""

from __future__ import annotations

import random
import re
from functools import cache

# How to reverse, after the word ("Spell {w} ..."). "reversed" reads as a participle.
HOW = (
    "backwards", "backward", "in reverse", "in reverse order", "reversed",
    "from right to left", "from the last letter to the first", "back to front",
    "the other way round", "the other way around", "in the opposite order",
    "with its letters reversed", "with the letters in reverse order", "end to start",
    "letter by letter in reverse", "from end to beginning", "right to left",
)  # fmt: skip
VERBS = (
    "spell", "write", "print", "show", "read", "output", "return", "write out", "spell out",
    "write down", "put", "rewrite", "display", "produce", "copy", "list", "render", "present",
)  # fmt: skip
# How the word is named.
OBJECTS = (
    "{w}", "{w}", "{w}", "the word {w}", "the string {w}", "the term {w}", "my word {w}",
    "this word, {w},", "the text {w}", "the name {w}",
)  # fmt: skip
# Words between the named word and how to reverse it.
FILLERS = (
    "", "", "", "", "out", "for me", "here", "now", "quickly", "please", "again",
    "carefully", "down", "for us", "exactly", "correctly", "for my class", "if you can",
    "one more time", "right now", "as a test",
)  # fmt: skip
ASKS = (
    "", "", "", "Please", "Can you", "Could you", "Would you", "Will you", "Can you please",
    "Could you please", "I need you to", "I want you to", "Try to", "Go ahead and",
    "Now", "Quickly", "Kindly", "Help me",
)  # fmt: skip
# Questions about the word: (opening, what the word does, reversed how).
QUESTIONS = (
    ("What is", ("", "spelled", "written", "when spelled", "when written", "when read")),
    ("What's", ("", "spelled", "written", "when written")),
    ("How is", ("spelled", "written", "read")),
    ("How does", ("read", "appear", "come out", "end up", "sound", "seem")),
    ("How would", ("read", "appear", "come out", "be spelled", "be written", "seem")),
    ("What would", ("be", "become", "read as", "come out as", "be when written")),
    ("What does", ("become", "read as", "come out as", "turn into", "spell")),
    ("Do you know how", ("is spelled", "is written", "reads")),
    ("Can you tell me how", ("is spelled", "is written", "reads")),
    ("Tell me how", ("is spelled", "is written", "reads")),
)
# The reversed word as a noun: "the {noun} of {w}".
NOUNS = (
    "reversal", "reversed form", "reversed spelling", "backwards spelling", "mirror image",
    "backward version", "reversed version", "letters in reverse", "reverse spelling",
)  # fmt: skip
NOUN_ASKS = (
    "What is the", "What's the", "Tell me the", "Show me the", "I need the", "Find the",
    "Write the", "Please write out the", "Can you find the", "Print the",
)  # fmt: skip
# Colon forms: the word last, other words before the colon.
LEADS = (
    "Reverse the {adj} word", "Reverse this {adj} word", "Here is a {adj} word to reverse",
    "The {adj} word to reverse", "{Verb} the {adj} word {how}", "{Verb} this {how}",
    "{Verb} {how}", "Word to {verb} {how}", "Reverse this {noun}", "Reverse the {noun}",
    "Please reverse the {adj} {noun}", "I need this {noun} reversed",
    "Can you reverse the {adj} word", "A {adj} word for you to reverse",
)  # fmt: skip
ADJECTIVES = (
    "next", "given", "single", "short", "new", "one", "last", "simple", "little", "English",
    "small", "random", "chosen", "second", "only",
)  # fmt: skip
COLON_NOUNS = ("word", "string", "text", "term", "input", "item", "name")
# The word first, then what to do with it.
AFTERS = (
    "{Verb} it {how}.", "Reverse it.", "Reverse it please.", "Can you {verb} it {how}?",
    "What is it {how}?", "Now {verb} it {how}.", "{Verb} that {how}.", "Reverse that word.",
    "I need it {how}.", "How is it spelled {how}?", "Please reverse that.",
)  # fmt: skip
WORD_FIRST = (
    "{w}: {after}", "{w}. {after}", "The word is {w}. {after}", "My word is {w}. {after}",
    "Take {w}. {after}", "Here is a word: {w}. {after}", "Word: {w}. {after}",
    "{w} -- {after}", "Consider {w}. {after}",
)  # fmt: skip


def _tokens(text: str) -> list[str]:
    return re.findall(r"\{w\}|[a-z']+", text.lower())


@cache
def _grams(held_out: tuple[str, ...]) -> tuple[frozenset[tuple[str, ...]], frozenset]:
    """The runs of four words of the ``held_out`` phrasings, and those shorter than four."""
    fours, shorts = set(), set()
    for text in held_out:
        toks = _tokens(text)
        if len(toks) < 4:
            shorts.add(tuple(toks))
        fours.update(tuple(toks[i : i + 4]) for i in range(len(toks) - 3))
    return frozenset(fours), frozenset(shorts)


@cache
def _words_of(held_out: tuple[str, ...]) -> frozenset[str]:
    return frozenset(w for text in held_out for w in _tokens(text))


def too_close(text: str, held_out: tuple[str, ...]) -> bool:
    """Whether ``text`` shares a run of four words with one of the ``held_out`` phrasings or
    holds a shorter one whole."""
    fours, shorts = _grams(held_out)
    toks = _tokens(text)
    grams = {tuple(toks[i : i + n]) for n in (1, 2, 3, 4) for i in range(len(toks) - n + 1)}
    return bool(grams & fours or grams & shorts)


def _join(*parts: str) -> str:
    return " ".join(p for p in parts if p)


def _capital(text: str) -> str:
    return text if text.startswith("{") else text[:1].upper() + text[1:]


def _end(text: str, mark: str) -> str:
    """``text`` capitalised, ending in ``mark`` (a trailing comma of "this word, {w}," goes)."""
    return _capital(text.rstrip(",")) + mark


def _draft(rng: random.Random) -> str:
    verb, how, obj = rng.choice(VERBS), rng.choice(HOW), rng.choice(OBJECTS)
    frame = rng.random()
    if frame < 0.3:  # "Could you spell the word {w} out backwards?"
        ask = rng.choice(ASKS)
        asking = ask.split(" ")[0] in ("Can", "Could", "Would", "Will")
        return _end(_join(ask, verb, obj, rng.choice(FILLERS), how), "?" if asking else ".")
    if frame < 0.4:  # "Reverse {w} for me"
        ask = rng.choice(ASKS)
        return _end(_join(ask, "reverse", obj, rng.choice(FILLERS)), rng.choice((".", "", "?")))
    if frame < 0.62:  # "How does {w} come out in reverse?"
        opening, doings = rng.choice(QUESTIONS)
        return _end(_join(opening, obj, rng.choice(doings), how), "?")
    if frame < 0.72:  # "What is the mirror image of {w}?"
        return _end(f"{rng.choice(NOUN_ASKS)} {rng.choice(NOUNS)} of {obj}", rng.choice("?."))
    if frame < 0.86:  # "Reverse the next word: {w}"
        lead = rng.choice(LEADS).format(
            adj=rng.choice(ADJECTIVES), noun=rng.choice(COLON_NOUNS), verb=verb,
            Verb=_capital(verb), how=how,
        )  # fmt: skip
        return f"{lead}: {{w}}"
    after = rng.choice(AFTERS).format(verb=verb, Verb=_capital(verb), how=how)
    return rng.choice(WORD_FIRST).replace("{after}", after)


def _with_verb(rng: random.Random, verb: str) -> str:
    """A request whose verb is ``verb``, a word of no request ("Plant me {w} backwards."):
    which word is the one to reverse shows only from where it stands."""
    how, obj = rng.choice(HOW), rng.choice(OBJECTS)
    frame = rng.random()
    if frame < 0.6:  # "Could you plant me the word {w} backwards?"
        ask = rng.choice(ASKS)
        asking = ask.split(" ")[0] in ("Can", "Could", "Would", "Will")
        to = rng.choice(("", "", "me", "us"))
        return _end(_join(ask, verb, to, obj, rng.choice(FILLERS), how), "?" if asking else ".")
    if frame < 0.8:  # "Plant this backwards: {w}"
        return f"{_capital(verb)} {rng.choice(('this', 'the word', 'it', 'me this'))} {how}: {{w}}"
    return rng.choice(WORD_FIRST).replace("{after}", f"{_capital(verb)} it {how}.")


def compose(
    rng: random.Random,
    held_out: tuple[str, ...],
    unfamiliar: float = 0.0,
    verbs: tuple[str, ...] = (),
) -> str:
    """A reversal request with ``{w}`` where the word goes, not :func:`too_close` to any of
    the ``held_out`` phrasings. ``unfamiliar``: the share whose verb is one of ``verbs``
    (words of the reversal task, none of a held-out phrasing) rather than of :data:`VERBS`,
    so that a verb never seen is not taken for the word to reverse."""
    held = _words_of(held_out)
    if unfamiliar and not any(v not in held for v in verbs):  # stops at the first usable verb
        raise ValueError("unfamiliar verbs need a word that no held-out phrasing uses")
    if unfamiliar and rng.random() < unfamiliar:
        while True:
            verb = rng.choice(verbs)
            if verb not in held:
                break
        while True:
            text = _with_verb(rng, verb)
            if not too_close(text, held_out):
                return text
    while True:
        text = _draft(rng)
        if not too_close(text, held_out):
            return text
