"""How people ask: phrasings, off-topic questions and chat context in the demo task stream,
with whole phrasings held out, and the held-out sets the model cards report."""

from __future__ import annotations

import functools
import itertools
import random
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dllm_serve.models.loader import load_model
from dllm_serve_train.__main__ import main
from dllm_serve_train.batches import BatchStream
from dllm_serve_train.char_tokens import spell_words_and_numbers
from dllm_serve_train.objectives import (
    ConsistencyPair,
    by_length,
    consistency_pair,
    encode,
    idlm_batch,
    llada_batch,
    loss,
)
from dllm_serve_train.off_topic import (
    CAPABILITY_REPLY,
    HELD_OUT_FAMILY,
    normalise,
    off_topic_held_out,
)
from dllm_serve_train.phrasings import (
    ADDITION,
    PREFIXES,
    REVERSAL,
    SUFFIXES,
    SYSTEM_PROMPTS,
    Template,
)
from dllm_serve_train.tasks import (
    PHRASING_SETS,
    TASKS,
    WEIGHTS,
    Example,
    examples,
    held_out_phrasings,
    is_held_out,
)
from dllm_serve_train.tiny_checkpoints import write_tiny
from dllm_serve_train.trimode_objective import trimode_batch

MIX = dict.fromkeys(TASKS, 0) | {
    "addition": 10,
    "reverse_word": 3,
    "reverse": 1,
    "reverse_long": 1,
    "off_topic": 3,
}


def _stream(split: str = "train", n: int = 4000, seed: int = 0) -> list[Example]:
    stream = examples(seed, split, weights=MIX, addition_operands="stratified",
                      phrasing=0.8, context=0.3)  # fmt: skip
    return list(itertools.islice(stream, n))


def _held_out_texts(templates) -> set[str]:
    return {t.text for t in templates if t.split == "held_out"}


def _right(ex: Example) -> bool:
    """Whether ``ex.answer`` answers ``ex.question`` (independently of how it was built)."""
    if ex.task == "addition":
        a, b = (int(n) for n in re.findall(r"\d+", ex.question))
        return ex.answer == f"{a} + {b} = {a + b}"
    if ex.task == "off_topic":
        return ex.answer == CAPABILITY_REPLY
    word = ex.answer[::-1]
    return re.search(rf"\b{word}\b", ex.question) is not None and word.isalpha()


def test_training_never_sees_a_held_out_phrasing_content_or_system_prompt() -> None:
    exs = _stream()
    assert exs == _stream()  # reproducible
    held_templates = _held_out_texts(ADDITION) | _held_out_texts(REVERSAL)
    held_systems = _held_out_texts(SYSTEM_PROMPTS)
    turns = [t for e in exs for t in e.context]
    assert {t for t in turns if t[0] == "system"}  # some examples carry a system prompt
    for ex in exs + [e for e in exs]:  # the questions of earlier turns come from the same draw
        assert ex.template not in held_templates
        assert not is_held_out(ex.key or ex.question) or ex.task == "off_topic"
        if ex.task == "off_topic":
            assert not off_topic_held_out(ex.key) and ex.template != HELD_OUT_FAMILY
        assert _right(ex), ex
    assert not {c for role, c in turns if role == "system"} & held_systems
    # Every user turn before the last is a training question too.
    earlier = {c for role, c in turns if role == "user"}
    assert not {normalise(q) for q in earlier} & {"hi", "tell me a joke", "who are you"}
    # Many phrasings, and the canonical question among them.
    assert len({e.template for e in exs if e.task == "addition"}) > 25
    assert ADDITION[0] == Template("What is {a} + {b}?", "train")  # the canonical question
    assert any(not e.template for e in exs if e.task == "addition")  # kept as it is
    assert {e.task for e in exs} == {t for t, w in MIX.items() if w}


def test_no_training_phrasing_wrapped_in_fillers_is_a_held_out_one() -> None:
    """A held-out template must be a phrasing of its own, not a training one with a prefix
    or suffix that training adds."""

    def shape(text: str) -> str:
        return normalise(text.replace("{", "").replace("}", ""))

    for templates in (ADDITION, REVERSAL):
        held = {shape(t.text) for t in templates if t.split == "held_out"}
        for t in (t for t in templates if t.split == "train"):
            body = t.text.rstrip(".?!")
            for head in ("", *PREFIXES):
                for tail in ("", *SUFFIXES):
                    assert shape(head + body + tail) not in held, (head, t.text, tail)


def test_surface_noise_keeps_the_answer_right() -> None:
    exs = _stream(n=6000, seed=3)
    questions = [e.question for e in exs]
    assert any(q != q.strip() for q in questions)  # leading or trailing whitespace
    assert any(q.isupper() for q in questions) and any(q.islower() for q in questions)
    assert any(re.search(r"\d\+\d", q) for q in questions)  # "2+2" as well as "2 + 2"
    upper = [e for e in exs if e.task == "reverse_word" and e.answer.isupper()]
    assert upper and all(_right(e) for e in upper)  # REVERSE HELLO -> OLLEH
    capital = [e for e in exs if e.task == "reverse_word" and e.answer[-1:].isupper()]
    assert capital and all(e.answer[-1] == e.answer[::-1][0] for e in capital)


def test_default_stream_is_the_canonical_questions() -> None:
    """Without --phrasing and --context the stream is what earlier demos trained on."""
    exs = list(itertools.islice(examples(7, "train"), 300))
    assert all(not e.context and not e.template and not e.key for e in exs)
    assert all(e.messages() == [{"role": "user", "content": e.question}] for e in exs)


@pytest.mark.parametrize("task", PHRASING_SETS)
def test_held_out_phrasings_are_held_out_twice(task: str) -> None:
    exs = held_out_phrasings(task, 150)
    assert len({e.question for e in exs}) == 150
    assert exs == held_out_phrasings(task, 150)
    for ex in exs:
        assert _right(ex), ex
        if task == "off_topic":
            assert off_topic_held_out(ex.key)
        else:
            assert is_held_out(ex.key)
            assert ex.template in _held_out_texts(ADDITION if task == "addition" else REVERSAL)
    if task == "addition":  # operands of one to three digits
        lengths = {len(n) for e in exs for n in re.findall(r"\d+", e.question)}
        assert lengths == {1, 2, 3}
    if task == "off_topic":
        families = sum(e.template == HELD_OUT_FAMILY for e in exs)
        assert 20 < families < 90


def test_the_issues_off_topic_prompts_are_held_out_in_any_spelling() -> None:
    for text in ("Hi", "hi!", " HI ", "Tell me a joke", "tell me a joke about cats.",
                 "Who are you?", "who are you"):  # fmt: skip
        assert off_topic_held_out(text), text
    assert not off_topic_held_out("hello there") or not off_topic_held_out("good morning")


def test_capability_reply_fits_the_default_canvas(tmp_path: Path) -> None:
    """The demos spell words one character per token: the reply and its end-of-turn token
    must fit the 32-token canvas a request without max_tokens gets."""
    for family in ("llada", "idlm", "nemotron"):
        path = write_tiny(family, tmp_path / family)
        spell_words_and_numbers(path)
        loaded = load_model(str(path), device="cpu", dtype="float32")
        _, answer = encode(loaded, Example("off_topic", "Hi", CAPABILITY_REPLY))
        assert len(answer) == 31, family
        assert loaded.tokenizer.decode(answer[:-1]) == CAPABILITY_REPLY


def test_context_is_rendered_by_the_chat_template_before_the_question(tmp_path: Path) -> None:
    loaded = load_model(str(write_tiny("idlm", tmp_path / "m")), device="cpu", dtype="float32")
    ex = Example(
        "addition",
        "What is 2 + 2?",
        "2 + 2 = 4",
        context=(("system", "Be brief."), ("user", "Hi"), ("assistant", CAPABILITY_REPLY)),
    )
    prompt, answer = encode(loaded, ex)
    text = loaded.tokenizer.decode(prompt)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        f"<|im_start|>assistant\n{CAPABILITY_REPLY}<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert answer == encode(loaded, Example("addition", "What is 2 + 2?", "2 + 2 = 4"))[1]


@pytest.mark.parametrize("family", ["llada", "idlm"])
def test_short_and_long_rows_split_without_changing_the_loss(tmp_path: Path, family: str) -> None:
    loaded = load_model(str(write_tiny(family, tmp_path / family)), device="cpu", dtype="float32")
    exs = _stream(n=32, seed=5)
    assert any(e.context for e in exs) and not all(e.context for e in exs)
    if family == "llada":
        batch = llada_batch(loaded, exs, random.Random(0), ar_fraction=0.5)
    else:
        batch = idlm_batch(loaded, exs, random.Random(0))
    parts = by_length(batch)
    assert len(parts) == 2 and parts[1].normalizer == 0.0
    assert sum(p.input_ids.numel() for p in parts) < batch.input_ids.numel()
    assert (
        sorted(p.input_ids.shape[0] for p in parts) != [0, 32]
        and sum(p.input_ids.shape[0] for p in parts) == 32
    )
    torch.manual_seed(0)
    with torch.no_grad():
        whole, split = loss(loaded.model, batch), loss(loaded.model, *parts)
    assert torch.allclose(whole, split, rtol=1e-5), (whole, split)


def test_phrasing_and_context_shares_are_checked() -> None:
    with pytest.raises(ValueError, match="shares between 0 and 1"):
        next(examples(0, "train", phrasing=1.5))
    assert WEIGHTS["off_topic"] == 0 and WEIGHTS["reverse_long"] == 0  # opt-in tasks


@pytest.mark.parametrize("family", ["llada", "idlm", "nemotron"])
def test_consistency_pairs_rows_that_differ_only_in_their_prompt(
    tmp_path: Path, family: str
) -> None:
    """Row i of ``after`` is an example after its context, row i of ``alone`` the same
    example without it: the same answer region, masks and targets after another prompt."""
    loaded = load_model(str(write_tiny(family, tmp_path / family)), device="cpu", dtype="float32")
    exs = [e for e in _stream(n=200, seed=3) if e.context][:6]
    make = {
        "llada": functools.partial(llada_batch, loaded, ar_fraction=0.5),
        "idlm": functools.partial(idlm_batch, loaded),
        "nemotron": functools.partial(trimode_batch, loaded, block_size=4),
    }[family]
    pair = consistency_pair(make, exs, random.Random(0), 0.5)
    assert pair.weight == 0.5 and pair.alone.input_ids.shape[0] == len(exs)
    for i, ex in enumerate(exs):
        long, short = (len(encode(loaded, e)[0]) for e in (ex, replace(ex, context=())))
        assert long > short
        after, alone = (b.targets[i][b.targets[i] != -100] for b in (pair.after, pair.alone))
        assert after.tolist() == alone.tolist()
        regions = [
            b.input_ids[i, n:][b.attn_mask[i, 0].diagonal()[n:]].tolist()
            for b, n in ((pair.after, long), (pair.alone, short))
        ]
        assert regions[0] == regions[1] and regions[0]


def test_consistency_term_is_the_kl_to_the_answer_alone_and_training_shrinks_it(
    tmp_path: Path,
) -> None:
    loaded = load_model(str(write_tiny("idlm", tmp_path / "m")), device="cpu", dtype="float32")
    exs = [e for e in _stream(n=200, seed=4) if e.context][:8]
    make = functools.partial(idlm_batch, loaded)
    pair = consistency_pair(make, exs, random.Random(1), 2.0)
    batch = idlm_batch(loaded, exs, random.Random(2))
    model = loaded.model
    with torch.no_grad():
        ce, both, term = loss(model, batch), loss(model, batch, pair), loss(model, pair)
        same = loss(model, ConsistencyPair(pair.alone, pair.alone, 2.0))
    torch.testing.assert_close(both, ce + term)
    assert term > 0 and float(same) == pytest.approx(0.0, abs=1e-6)
    # Only the answer after the context learns: the alone prediction is the fixed target.
    model.requires_grad_(True)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(30):
        opt.zero_grad()
        loss(model, pair).backward()
        opt.step()
    with torch.no_grad():
        assert loss(model, pair) < 0.25 * term


def test_batch_stream_adds_a_consistency_pair_over_a_quarter_of_the_context_rows(
    tmp_path: Path,
) -> None:
    loaded = load_model(str(write_tiny("idlm", tmp_path / "m")), device="cpu", dtype="float32")
    kwargs = {"phrasing": 0.8, "context": 0.6, "addition_operands": "stratified"}
    plain = next(iter(BatchStream(loaded, "idlm", 0, 32, MIX, 32, **kwargs)))
    paired = next(iter(BatchStream(loaded, "idlm", 0, 32, MIX, 32, consistency=1.0, **kwargs)))
    assert not any(isinstance(p, ConsistencyPair) for p in plain)
    *batches, pair = paired
    assert isinstance(pair, ConsistencyPair) and pair.weight == 1.0
    assert [b.input_ids.tolist() for b in batches] == [b.input_ids.tolist() for b in plain]
    assert pair.after.input_ids.shape[0] == 8  # 32 // 4 of the batch's context rows
    assert pair.after.input_ids.shape[1] > pair.alone.input_ids.shape[1]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--consistency", "1"], "--consistency pairs rows asked after a context: add --context"),
        (["--context", "0.5", "--consistency", "-1"], "--consistency must be a finite number >= 0"),
    ],
)
def test_consistency_is_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    with pytest.raises(SystemExit):
        main(["--family", "idlm", "--steps", "1", *extra, "--out", str(tmp_path / "x")])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
