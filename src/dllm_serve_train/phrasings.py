"""How people ask: the demo tasks in many phrasings, and the system prompts and earlier turns
a chat client sends along.

A demo trained on ``What is 123 + 456?`` alone answers that template and little else:
``what is 2 + 2`` (no capital, no question mark) or ``Reverse the word hello`` (no period)
came out as garbage. Here each task has two sets of **templates**, whole phrasings: those of
:data:`ADDITION` / :data:`REVERSAL` with ``split="train"`` are trained on, those with
``split="held_out"`` never are, so the accuracy on them measures how far the model
understands a request it has not seen phrased that way. The content of a question (the
operands, the word) is split as before (:func:`dllm_serve_train.tasks.is_held_out` of its
canonical question): a held-out phrasing is scored on held-out content, so neither the
phrasing nor the sum was ever trained on. Surface noise (case, punctuation, spacing around
``+``, quotes, leading and trailing whitespace) applies to both splits alike: it is not a
phrasing. Questions the demos cannot answer are ``off_topic.py``'s; here they get the same
surface noise.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass, replace

from dllm_serve_train.composed import compose
from dllm_serve_train.off_topic import CAPABILITY_REPLY, off_topic_question


@dataclass(frozen=True, slots=True)
class Example:
    """One chat turn to answer: ``question`` is the last user message, ``context`` the
    (role, content) messages before it (a system prompt, earlier turns), ``key`` the
    canonical question whose hash decided the split ("" when it is ``question`` itself) and
    ``template`` the phrasing it was asked in (below; "" for the canonical one)."""

    task: str
    question: str
    answer: str
    context: tuple[tuple[str, str], ...] = ()
    key: str = ""
    template: str = ""

    def messages(self) -> list[dict[str, str]]:
        """The conversation as chat messages, the question last."""
        turns = [*self.context, ("user", self.question)]
        return [{"role": role, "content": content} for role, content in turns]


@dataclass(frozen=True, slots=True)
class Template:
    """One phrasing of a task: ``{a}`` / ``{b}`` (operands) or ``{w}`` (the word)."""

    text: str
    split: str  # "train" or "held_out"


def _templates(train: list[str], held_out: list[str]) -> tuple[Template, ...]:
    return tuple(Template(t, "train") for t in train) + tuple(
        Template(t, "held_out") for t in held_out
    )


# The first training template is the canonical question (tasks.py), trained most often.
ADDITION = _templates(
    train=[
        "What is {a} + {b}?",
        "What is {a} plus {b}?",
        "What's {a} + {b}?",
        "What's {a} plus {b}?",
        "Whats {a} + {b}",
        "{a} + {b}",
        "{a} + {b} =",
        "{a} + {b} = ?",
        "{a} + {b} =?",
        "{a} plus {b}",
        "{a} plus {b} equals?",
        "Add {a} and {b}.",
        "Add {a} to {b}.",
        "Please add {a} and {b}.",
        "Can you add {a} and {b}?",
        "Calculate {a} + {b}.",
        "Calculate {a} plus {b}",
        "Compute {a} + {b}",
        "What is the sum of {a} and {b}?",
        "Sum of {a} and {b}",
        "Find the sum of {a} and {b}.",
        "Sum {a} and {b}.",
        "Total of {a} and {b}",
        "How much is {a} + {b}?",
        "How much is {a} plus {b}?",
        "What does {a} + {b} equal?",
        "Tell me {a} + {b}.",
        "Solve {a} + {b}",
        "{a} + {b} is?",
        "What is {a} added to {b}?",
        "Work out {a} + {b}.",
        "What do {a} and {b} add up to?",
        "Answer this: {a} + {b}",
        "Can you calculate {a} plus {b}?",
        "How much do {a} and {b} make?",
        "{a} and {b} added together",
        "Add up {a} and {b}.",
        "Please compute {a} + {b}.",
        "What is {a} + {b} equal to?",
        "{a} + {b} equals what?",
        "Find {a} plus {b}.",
        "What would {a} + {b} be?",
        "Can you work out {a} plus {b}?",
        "Let's add {a} and {b}.",
        "What's the answer to {a} + {b}?",
        "Addition: {a} + {b}",
        "What is the total of {a} plus {b}?",
        "I'd like to know {a} + {b}.",
        "What's the sum of {a} and {b}?",
        "Add these: {a} and {b}",
        "Sum: {a} + {b}",
        "Please tell me {a} plus {b}.",
        "Can you do {a} + {b}?",
        "How much is {a} and {b} together?",
        "Combine {a} and {b}.",
        "Math: {a} + {b}",
        "What is {a} + {b} in total?",
        "Total: {a} + {b}",
        "Find the total of {a} and {b}.",
        "Work out the sum of {a} and {b}.",
        "What does {a} plus {b} make?",
        "Adding {a} and {b} gives?",
    ],
    held_out=[
        "What do you get if you add {a} and {b}?",
        "Could you tell me what {a} + {b} is?",
        "I need the sum of {a} and {b}.",
        "Quick one: {a} plus {b}?",
        "Evaluate {a} + {b}.",
        "Give me {a} + {b}.",
        "{a} added to {b} makes what?",
        "Help me add {a} and {b}",
        "Result of {a} + {b}?",
        "If you add {a} to {b}, what do you get?",
        "Mind adding {a} and {b}?",
        "Do the sum {a} plus {b} for me.",
    ],
)
REVERSAL = _templates(
    train=[
        "Reverse the word {w}.",
        "Reverse {w}",
        "Reverse the word: {w}",
        "Reverse the letters of {w}.",
        "Reverse the string {w}.",
        "Spell {w} backwards.",
        "Spell {w} backward",
        "How is {w} spelled backwards?",
        "{w} reversed",
        "{w} backwards",
        "What is {w} reversed?",
        "What's {w} backwards?",
        "Can you reverse {w}?",
        "Please reverse the word {w}.",
        "Write {w} backwards.",
        "Write {w} in reverse.",
        "Reverse the order of the letters in {w}.",
        "Flip the word {w}.",
        "{w} in reverse",
        "Reverse this: {w}",
        "Backwards: {w}",
        "Can you spell {w} backwards?",
        "Reverse the letters in {w}.",
        "Can you write {w} backwards?",
        "What's {w} in reverse?",
        "Read {w} backwards.",
        "{w} spelled backwards",
        "Print {w} reversed.",
        "Show me {w} backwards.",
        "Please spell the word {w} backwards.",
        "What do you get when you reverse {w}?",
        "Reverse it: {w}",
        "Write the word {w} backwards.",
        "Output {w} reversed.",
        "Can you flip {w}?",
        "Reverse the spelling of {w}.",
        "What is {w} spelled in reverse?",
        "Please write {w} backwards.",
        "Mirror the word {w}.",
        "Return {w} reversed.",
        "Reverse this word: {w}",
        "Could you reverse {w}?",
        "Word: {w}. Reverse it.",
        "Take {w} and reverse it.",
        "Invert the letters of {w}.",
        "Spell out {w} in reverse order.",
        "Let's reverse {w}.",
        "How does {w} read backwards?",
        "Put {w} in reverse order.",
        "Can you turn {w} around?",
        "What's the word {w} backwards?",
        "Write {w} from the last letter to the first.",
        # The word to reverse is not always the one before the cue: other words sit between.
        "How would {w} appear if written backwards?",
        "Write {w} out backwards.",
        "Spell {w} out for me backwards.",
        "Show {w} to me in reverse.",
        "What is {w} when you read it backwards?",
        "What does {w} become when reversed?",
        "What would {w} be if you spelled it backwards?",
        "Could you put {w} into reverse, please?",
        "Please write {w} down in reverse order.",
        "Tell me how {w} is spelled backwards.",
        "Can you show me how {w} reads in reverse?",
        "Write {w} with its letters backwards.",
        "Reverse {w} letter by letter.",
        "Please make {w} read backwards.",
        "What is {w} with the letters in reverse?",
        "Rearrange {w} from back to front.",
        "Write {w} starting from its last letter.",
        "Lay {w} out in reverse.",
        "{w} -- what is it backwards?",
        "Take the word {w} and write it backwards.",
        # ... and words other than "word" sit before the colon.
        "Reverse this short word: {w}",
        "Here is a word to reverse: {w}",
        "The word is {w}. Write it backwards.",
        "Reverse the English word {w}.",
        "My word is {w}; spell it backwards.",
    ],
    held_out=[
        "How do you write {w} backwards?",
        "Give me {w} reversed.",
        "What does {w} look like backwards?",
        "Could you write the word {w} in reverse?",
        "Type {w} backwards for me.",
        "I want {w} reversed.",
        "Reverse the following word: {w}",
        "What is the reverse of {w}?",
        "Say {w} backwards.",
        "Turn {w} backwards, please.",
    ],
)
# Words people put around a request, trained with every training template (never with a
# held-out one): they teach that a request's wording around its content does not matter.
PREFIXES = (
    "Please ", "Hey, ", "Hi! ", "Question: ", "Can you tell me ", "I want to know: ",
    "Tell me, ", "OK, ", "So ", "Now ", "Hello, ", "Excuse me, ", "Next: ", "Ok so ",
    "I have a question. ", "My teacher asked me this. ", "For my homework: ", "Hmm. ",
    "Let me ask you something. ", "I'm curious. ", "Hello there! ", "Good morning. ",
    "One more: ", "Alright, ", "Simple one: ", "Test: ", "Task: ", "Well, ",
)  # fmt: skip
SUFFIXES = (
    " please", " thanks", " for me", " now", " thank you", " quickly", " pls", ", ok?",
    ". Thanks a lot!", ". I need it fast.", " (just the answer)", " if you can",
    " right now", ", please and thank you", ". Be quick", " again",
)  # fmt: skip

# Tasks whose questions are rephrased, and their templates.
PHRASED = {
    "addition": ADDITION,
    "reverse_word": REVERSAL,
    "reverse": REVERSAL,
    "reverse_long": REVERSAL,
}

SYSTEM_PROMPTS = _templates(
    train=[
        "You are a helpful assistant.",
        "You are a helpful assistant",
        "You are a calculator.",
        "Be concise.",
        "Answer briefly.",
        "You are a friendly bot.",
        "Reply in one line.",
        "You are an AI assistant. Answer the user's questions.",
        "Keep answers short.",
        "You are a small demo model.",
        "Only give the answer.",
        "You are a math tutor.",
        "Think step by step.",
        "You are a pirate.",
        "Respond in English.",
        "You are a helpful and harmless AI.",
        "Be precise.",
        "You are ChatBot.",
    ],
    held_out=[
        "You are a helpful, honest and harmless assistant.",
        "Always answer politely.",
        "You are an expert assistant. Be accurate.",
        "Answer the question.",
        "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
        "Be brief and correct.",
        "You are a assistant for kids.",
        "Use as few words as you can.",
    ],
)

# ---- surface noise ------------------------------------------------------------------------


def _plus_spacing(text: str, rng: random.Random) -> str:
    spaced = rng.choice((" + ", " + ", "+", " +", "+ "))
    return text.replace(" + ", spaced)


def _end(text: str, rng: random.Random) -> str:
    """The trailing punctuation people type, or none."""
    stem = text.rstrip(".?!")
    # "2 + 2 =" keeps its sign ("=?" is a phrasing of its own); "?" alone stays a question
    if stem.rstrip().endswith("=") or not stem.strip():
        return text
    return stem + rng.choice(("", "", ".", "?", "?", "!", " ?", "??"))


_CASES = (("lower", 0.2), ("first_lower", 0.08), ("upper", 0.05), ("title", 0.03))


def _case_mode(rng: random.Random) -> str:
    u = rng.random()
    for mode, share in _CASES:
        if u < share:
            return mode
        u -= share
    return "as_is"


def _cased(text: str, mode: str) -> str:
    if mode == "lower":
        return text.lower()
    if mode == "upper":
        return text.upper()
    if mode == "title":
        return text.title()
    if mode == "first_lower":
        return text[:1].lower() + text[1:]
    return text


def _spaces(text: str, rng: random.Random) -> str:
    if rng.random() < 0.12:
        text = rng.choice((" ", "  ", "\n", " \n")) + text
    if rng.random() < 0.12:
        text += rng.choice((" ", "  ", "\n", " \n"))
    return text


def noisy(text: str, rng: random.Random, word: str | None = None) -> tuple[str, str]:
    """``text`` with case, punctuation and whitespace varied. ``word`` (a reversal's) goes
    where ``text`` holds ``{w}``, cased as a person typing that way would case it; returns
    the question and the word as it appears in it ("" without a word)."""
    mode = _case_mode(rng)
    if word is None:
        return _spaces(_end(_cased(text, mode), rng), rng), ""
    head, _, tail = text.partition("{w}")
    if mode == "first_lower":  # only the question's first letter changes
        shown = word if head else _cased(word, mode)
        head = _cased(head, mode)
    else:
        shown = word.capitalize() if mode == "title" else _cased(word, mode)
        head, tail = _cased(head, mode), _cased(tail, mode)
    return _spaces(_end(head + "{w}" + tail, rng), rng).replace("{w}", shown), shown


# ---- rendering ------------------------------------------------------------------------------


def _addition_operands(question: str) -> tuple[int, int]:
    m = re.fullmatch(r"What is (\d+) \+ (\d+)\?", question)
    assert m, question
    return int(m[1]), int(m[2])


def _reversal_word(question: str) -> str:
    return question.removeprefix("Reverse the word ").removesuffix(".")


def templates(task: str, split: str) -> list[Template]:
    return [t for t in PHRASED[task] if t.split == split]


def phrasing_counts() -> dict[str, int]:
    """How many training phrasings each task has now (a run records them, so that its model
    card stays true after phrasings are added)."""
    return {task: len(templates(task, "train")) for task in ("addition", "reverse_word")}


def _wrapped(text: str, rng: random.Random) -> str:
    """``text`` with a prefix (its first letter then lower-cased unless it starts with a
    placeholder), a suffix before its final punctuation, or both."""
    u = rng.random()
    if u < 0.7:
        head = rng.choice(PREFIXES)
        text = head + (text if text.startswith("{") else text[:1].lower() + text[1:])
    if u >= 0.5:
        stem = text.rstrip(".?!")
        text = stem + rng.choice(SUFFIXES) + text[len(stem) :]
    return text


def rephrase(
    ex: Example,
    rng: random.Random,
    split: str,
    composed: float = 0.0,
    unfamiliar: float = 0.0,
    verbs: tuple[str, ...] = (),
) -> Example:
    """``ex`` (a canonical question of a phrased task) asked in a random ``split`` template
    with surface noise. ``composed``: the share of training reversals asked in a phrasing
    of ``composed.py`` instead of a written template; ``unfamiliar``: the share of those
    whose verb is one of ``verbs`` (other words of the task)."""
    template = rng.choice(templates(ex.task, split))
    text = template.text
    if composed and split == "train" and ex.task != "addition" and rng.random() < composed:
        held_out = tuple(t.text for t in templates(ex.task, "held_out"))
        word = _reversal_word(ex.question)
        others = tuple(v for v in verbs if v != word)
        template = Template(compose(rng, held_out, unfamiliar, others), "train")
        text = template.text
    if split == "train" and rng.random() < 0.35:
        text = _wrapped(text, rng)
    if ex.task == "addition":
        a, b = _addition_operands(ex.question)
        text = _plus_spacing(text.format(a=a, b=b), rng)
        question, _ = noisy(text, rng)
        return replace(ex, question=question, key=ex.key or ex.question, template=template.text)
    word = _reversal_word(ex.question)
    if rng.random() < 0.08:  # "Reverse the word Hello": the answer is "olleH"
        word = word.capitalize()
    quote = rng.random()
    quote = '"' if quote < 0.08 else "'" if quote < 0.14 else ""
    question, shown = noisy(text.replace("{w}", quote + "{w}" + quote), rng, word)
    return replace(
        ex,
        question=question,
        answer=shown[::-1],
        key=ex.key or ex.question,
        template=template.text,
    )


def off_topic(rng: random.Random, split: str, words: tuple[str, ...]) -> Example:
    text, family = off_topic_question(rng, split, words)
    question, _ = noisy(text, rng)
    return Example("off_topic", question, CAPABILITY_REPLY, key=text, template=family)


def with_context(
    ex: Example, rng: random.Random, split: str, earlier: Callable[[], Example]
) -> Example:
    """``ex`` after a system prompt, earlier turns, or both: the answer stays the last
    question's. An earlier turn is another example with its own answer (now and then
    another reply, as a chat with some other model would hold)."""
    turns: list[tuple[str, str]] = []
    u = rng.random()
    if u < 0.7:
        turns.append(("system", rng.choice([t.text for t in SYSTEM_PROMPTS if t.split == split])))
    if u >= 0.45:
        for _ in range(1 if rng.random() < 0.75 else 2):
            before = earlier()
            reply = before.answer if rng.random() < 0.9 else earlier().answer
            turns += [("user", before.question), ("assistant", reply)]
    return replace(ex, context=tuple(turns))
