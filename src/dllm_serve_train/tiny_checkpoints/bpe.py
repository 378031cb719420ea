"""A small byte-level BPE learned from a fixed corpus, shared by every tiny checkpoint.

Bytes sit at ids 0-255 (GPT-2 byte-to-unicode order), learned merges follow, and each family's
special tokens are placed either right after them (small vocabulary) or at their real ids.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

N_MERGES = 499  # 256 bytes + 499 merges + LLaDA's 269 specials = 1024 rows, a multiple of 64

# The BPE merges are learned from this text. It is fixed so the tokenizer is reproducible; it
# is ordinary chat-flavoured English so that common words become single tokens.
CORPUS = """\
Hello! How are you today? I am fine, thank you. What can I do for you?
Hello, hello, hello. Hi there. Good morning, good afternoon and good evening.
You are a helpful assistant. The user asks a question and the assistant gives an answer.
Please answer the question in one short sentence. Explain your reasoning step by step.
What is the capital of France? The capital of France is Paris.
What is the capital of Germany? The capital of Germany is Berlin.
What is two plus two? Two plus two is four. What is three times three? It is nine.
The quick brown fox jumps over the lazy dog. The dog was not amused by the fox.
Write a short poem about the sea. The sea is wide and the waves are blue and white.
Can you help me write a story? Once upon a time there was a little cat who lived in a house.
The cat liked to sleep in the sun and to play with the children of the family every day.
Tell me a joke. Why did the chicken cross the road? To get to the other side.
Thank you very much for your help. You are welcome; I am happy to help with anything.
Diffusion language models generate text by filling in masked tokens over many steps.
The model looks at the whole sequence at once and predicts every masked position in parallel.
At each step the most confident predictions are kept and the others are masked again.
This server streams the answer to the client as soon as the text at the start is final.
Python is a programming language. Here is a function that returns the sum of two numbers.
def add(a, b): return a + b. The function takes two arguments and returns their sum.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 2024. Dates: Monday, Tuesday, Friday.
The weather is nice today. It is sunny and warm, but it may rain later in the evening.
I think that this is a good idea. Do you think so too? Yes, I do. No, I do not.
Summarize the following text in three sentences. The main point of the text is simple.
Translate this sentence into French: I like to read books. J'aime lire des livres.
Where is the nearest train station? It is about five minutes from here on foot.
Learning takes time and practice. Read the question carefully before you answer it.
The history of science is the study of how people came to understand the natural world.
Water boils at one hundred degrees and freezes at zero degrees on the Celsius scale.
Sorry, I do not know the answer to that question. Could you give me more information?
Let us think about this problem together and find a solution that works for everyone.
The first step is to understand the problem. The second step is to make a plan.
Here are some ideas: go for a walk, read a book, cook a meal or call a friend.
Because the model is small and random, its answers will be gibberish, not good advice.
hello
hello world, hello again. hello, who are you?
what is the answer? what do you mean? what time is it?
how do I cook rice? how are you? the end. the answer is yes. thanks!
"""


def byte_symbols() -> list[str]:
    """The 256 byte-level symbols in byte order (the GPT-2 byte-to-unicode table).

    Printable Latin-1 bytes stand for themselves; the rest are shifted to U+0100 onwards so
    that every byte has a visible, non-whitespace symbol.
    """
    direct = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
              *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
    shifted = iter(range(256, 512))
    return [chr(b) if b in direct else chr(next(shifted)) for b in range(256)]


@functools.cache
def learn_bpe() -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, int], ...]]:
    """``(merges, vocab items)`` learned from :data:`CORPUS`; deterministic."""
    symbols = byte_symbols()
    assert set(symbols) == set(pre_tokenizers.ByteLevel.alphabet())
    trainer = trainers.BpeTrainer(
        vocab_size=256 + N_MERGES, min_frequency=1, show_progress=False,
        initial_alphabet=symbols, special_tokens=[],
    )  # fmt: skip
    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    learner.train_from_iterator(CORPUS.splitlines(), trainer)
    merges = [tuple(m) for m in json.loads(learner.to_str())["model"]["merges"]]
    # Re-number: the trainer orders its alphabet by code point; we want byte order, then each
    # merged token at its first appearance (two merges can produce the same string).
    vocab = {s: i for i, s in enumerate(symbols)}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    return tuple(merges), tuple(vocab.items())  # type: ignore[return-value]


def base_vocab_size() -> int:
    """Ids used by bytes and merges; small-vocabulary specials start here."""
    return len(learn_bpe()[1])


def build_tokenizer(
    specials: Sequence[str], special_ids: Mapping[str, int] | None = None
) -> Tokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenizer) plus ``specials``: appended in order, or
    at ``special_ids`` (non-contiguous ids are fine: they live in the BPE vocabulary)."""
    merges, items = learn_bpe()
    vocab = dict(items)
    if special_ids is not None:
        vocab.update(special_ids)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tok


def qwen2_vocab_files(special_ids: Mapping[str, int] | None = None) -> tuple[str, str]:
    """``(vocab.json, merges.txt)`` texts in Qwen2's format (base vocabulary only, as in the
    real files). ``special_ids`` adds tokens at ids that do not follow the base vocabulary:
    ``added_tokens_decoder`` alone cannot place a token past a gap, so it goes in vocab.json."""
    merges, items = learn_bpe()
    vocab = dict(items)
    if special_ids is not None:
        vocab.update(special_ids)
    vocab_json = json.dumps(vocab, ensure_ascii=False)
    merges_txt = "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges)
    return vocab_json, merges_txt
