"""Questions the demos cannot answer, and the one reply they give them.

Anything but an addition or a word reversal (a greeting, another operation, a request the
demos cannot serve) gets :data:`CAPABILITY_REPLY`, which says what the model can do. It must
fit the demos' default 32-token canvas with its end-of-turn token: the demos spell words one
character per token, so it is at most 31 characters. Prompts are split into trained and held
out by their own rule (:func:`off_topic_held_out`), not by the content hash of the tasks.
"""

from __future__ import annotations

import hashlib
import random
import re

# What the demos answer to anything but an addition or a word reversal: exactly what they do.
CAPABILITY_REPLY = "I add 0-999 and reverse words."

_HELD_OUT_OFF_TOPIC_PERCENT = 15


# Off-topic questions: fixed lists and combinations, split by a hash of the normalised text
# (a sixth or so held out) and by whole families that training never sees (``held_out``).
_GREETINGS = [
    "hello", "hey", "hi there", "good morning", "good evening", "hey there", "yo", "howdy",
    "greetings", "sup", "what's up", "hello there", "good afternoon", "hiya", "morning",
    "hey you", "hello bot", "heya", "good night", "hi friend", "hey buddy", "hallo", "hola",
    "bonjour",
]  # fmt: skip
_SMALL_TALK = [
    "thanks", "thank you", "ok", "okay", "cool", "bye", "goodbye", "lol", "help", "test",
    "testing", "what can you do?", "how are you?", "are you there?", "what are you?",
    "what's your name?", "are you a robot?", "who made you?", "are you human?",
    "can you help me?", "how does this work?", "what should I ask?", "nice", "great",
    "wow", "I am bored", "I love you", "you are wrong", "that is not right", "hmm", "yes",
    "no", "why?", "really?", "what?", "?", "...", "!", "hi how are you", "how old are you?",
    "where are you from?", "what time is it?", "what day is it today?", "do you like music?",
    "are you smart?", "what model are you?", "who created you?", "can you talk?",
]  # fmt: skip
_REQUEST_VERBS = ["Tell me", "Write", "Give me", "Show me", "Can you write", "Please write"]
_REQUEST_OBJECTS = [
    "a story", "a poem", "a song", "a riddle", "a fun fact", "the news", "a recipe",
    "something interesting", "a haiku", "an essay about dogs", "a limerick", "a letter",
    "a story about a dragon", "a poem about the sea", "a quote", "some advice", "a secret",
    "a tongue twister", "an email to my boss", "a list of fruits", "a summary of a book",
    "a fact about space", "code for a website", "a python function",
]  # fmt: skip
_TOPICS = [
    "love", "the capital of France", "the meaning of life", "Python", "a black hole",
    "the weather today", "photosynthesis", "gravity", "an atom", "democracy", "the moon",
    "machine learning", "a diffusion model", "your favourite colour", "the best movie",
    "a prime number", "the speed of light", "DNA", "the internet", "music", "happiness",
    "the tallest mountain", "the biggest ocean", "a dog", "football", "chess",
]  # fmt: skip
_QUESTION_FRAMES = [
    "What is {t}?", "Explain {t}.", "Tell me about {t}.", "Describe {t}.",
    "What do you know about {t}?", "Can you explain {t}?", "Why is {t} important?",
]  # fmt: skip
_HOW_TO = [
    "cook pasta", "learn French", "fix my bike", "sleep better", "get rich", "code in Rust",
    "tie a tie", "make friends", "write a CV", "bake bread", "lose weight", "play guitar",
    "install python", "reset my password", "grow tomatoes",
]  # fmt: skip
# Arithmetic the demos do not do, and word tasks other than reversal: the phrasings that
# look most like the real tasks, so they teach the model to read the operation.
_OTHER_MATH = [
    "What is {a} - {b}?", "What is {a} minus {b}?", "{a} - {b}", "{a} * {b}", "{a} x {b}",
    "What is {a} times {b}?", "Multiply {a} and {b}.", "Multiply {a} by {b}",
    "Subtract {b} from {a}.", "Divide {a} by {b}.", "{a} / {b}", "What is {a} divided by {b}?",
    "What is the square root of {a}?", "What is {a} squared?", "Is {a} a prime number?",
    "Count to {a}.", "What is {a} to the power of {b}?", "What is {a} % {b}?",
    "What is the product of {a} and {b}?", "What is the difference of {a} and {b}?",
    "Is {a} bigger than {b}?", "What is half of {a}?", "What is {a}?", "{a}",
    "Which is larger, {a} or {b}?", "Round {a} to the nearest ten.",
]  # fmt: skip
_OTHER_WORD = [
    "Sort the letters of {w}.", "How many letters are in {w}?", "What does {w} mean?",
    "Spell {w}.", "Uppercase {w}.", "Translate {w} to French.", "What rhymes with {w}?",
    "Use {w} in a sentence.", "Define {w}.", "Is {w} a word?", "Repeat {w}.", "Say {w}.",
    "What is the first letter of {w}?", "Count the vowels in {w}.", "{w}",
    "Capitalize {w}.", "Write a sentence with {w}.", "What is a synonym for {w}?",
    "Sort {w} alphabetically.",
]  # fmt: skip
# Families never trained on (with the three the issue names), to measure the reply on
# questions of a kind the model has not seen.
_HELD_OUT_FAMILIES = [
    "Hi", "Tell me a joke", "Who are you?", "Tell me a joke about cats.", "Make me laugh.",
    "Who is the president?", "Who won the world cup?", "Where is Paris?",
    "Write a haiku about autumn.", "Recommend a good book.", "What is your purpose?",
    "Can you speak Spanish?", "Sing me a song.", "What's the weather like?",
    "Please help me with my homework.", "Summarize the plot of Hamlet.",
    "Translate good morning into German.", "What is {a} minus {b}, please?",
    "Multiply {a} with {b}.", "Sort these letters: {w}", "How many vowels does {w} have?",
    "What is the opposite of {w}?", "Why is the sky blue?", "Do you dream?",
    "Give me a random number.", "Is it going to rain tomorrow?", "What can I cook tonight?",
    "good day to you", "Hey! How's it going?", "Explain how a car engine works.",
]  # fmt: skip
# The three prompts the issue names, in any case or punctuation: never trained on.
_ALWAYS_HELD_OUT = {"hi", "tell me a joke", "who are you"}


def normalise(text: str) -> str:
    """Lower case, letters, digits and single spaces: what makes two prompts "the same"."""
    return " ".join(re.sub(r"[^a-z0-9' ]+", " ", text.lower()).split())


def _family_pattern(frame: str) -> re.Pattern[str]:
    marked = frame.format(a="zzazz", b="zzbzz", w="zzwzz")
    pattern = re.escape(normalise(marked))
    for mark, what in (("zzazz", r"\d+"), ("zzbzz", r"\d+"), ("zzwzz", r"[a-z']+")):
        pattern = pattern.replace(mark, what)
    return re.compile(pattern)


_FAMILY_PATTERNS = [_family_pattern(frame) for frame in _HELD_OUT_FAMILIES]


def off_topic_held_out(text: str) -> bool:
    """Whether an off-topic prompt is held out: the issue's three in any spelling, anything
    about a joke, whatever a held-out family can say, and about a sixth of all others by a
    hash of the normalised text."""
    key = normalise(text)
    if key in _ALWAYS_HELD_OUT or "joke" in key.split():
        return True
    if any(p.fullmatch(key) for p in _FAMILY_PATTERNS):
        return True
    digest = hashlib.sha256(("off-topic:" + key).encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < _HELD_OUT_OFF_TOPIC_PERCENT


def _fill(frame: str, rng: random.Random, words: tuple[str, ...]) -> str:
    return frame.format(a=rng.randint(0, 999), b=rng.randint(0, 999), w=rng.choice(words))


# The template field of an off-topic question from a family never trained on.
HELD_OUT_FAMILY = "held-out family"


def off_topic_question(rng: random.Random, split: str, words: tuple[str, ...]) -> tuple[str, str]:
    """One off-topic prompt of ``split`` (surface noise not yet applied), and
    :data:`HELD_OUT_FAMILY` when it is of a family never trained on (else "")."""
    if split == "held_out" and rng.random() < 0.35:
        return _fill(rng.choice(_HELD_OUT_FAMILIES), rng, words), HELD_OUT_FAMILY
    while True:
        kind = rng.random()
        if kind < 0.12:
            text = rng.choice(_GREETINGS)
        elif kind < 0.3:
            text = rng.choice(_SMALL_TALK)
        elif kind < 0.45:
            text = f"{rng.choice(_REQUEST_VERBS)} {rng.choice(_REQUEST_OBJECTS)}"
        elif kind < 0.58:
            text = rng.choice(_QUESTION_FRAMES).format(t=rng.choice(_TOPICS))
        elif kind < 0.65:
            text = f"How do I {rng.choice(_HOW_TO)}?"
        elif kind < 0.85:
            text = _fill(rng.choice(_OTHER_MATH), rng, words)
        else:
            text = _fill(rng.choice(_OTHER_WORD), rng, words)
        if off_topic_held_out(text) == (split == "held_out"):
            return text, ""
