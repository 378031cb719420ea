"""Structured output (response_format) is enforced: every answer of a random-weight model parses
and validates against its schema, in canvas denoising (tiny LLaDA, tiny Dream, demo-llada) and
block diffusion (tiny LLaDA2.x), under top-k and threshold commits, greedy and sampled;
batched answers equal solo ones; modes that cannot enforce it refuse it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
from structured_schemas import SCHEMAS, response_format

from dllm_serve.decoding.grammar import (
    Constraint,
    GrammarError,
    TokenGrammar,
    response_format_grammar,
)
from dllm_serve.llm import LLM, InvalidRequestError
from dllm_serve_train.tiny_checkpoints import (
    write_tiny_dream,
    write_tiny_idlm,
    write_tiny_llada,
    write_tiny_llada2,
)

ASSETS = Path(__file__).resolve().parents[3] / "src" / "dllm_serve" / "assets"
CONVERSATION = [{"role": "user", "content": "Answer in JSON."}]
MAX_TOKENS = 64  # every schema here has a valid answer far shorter than this


@pytest.fixture(scope="module", params=["llada", "dream", "llada2", "demo-llada"])
def llm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    """A tiny random checkpoint of each enforcing mode (LLaDA and Dream: canvas denoising;
    LLaDA2.x, block 8: block diffusion) and the trained demo-llada."""
    root = Path(tmp_path_factory.mktemp(request.param))
    path = {
        "llada": lambda: write_tiny_llada(root / "m"),
        "dream": lambda: write_tiny_dream(root / "m"),
        "llada2": lambda: write_tiny_llada2(root / "m", block_size=8, seed=3),
        "demo-llada": lambda: ASSETS / "demo-llada",
    }[request.param]()
    with LLM(str(path), device="cpu", dtype="float32") as model:
        model.test_name = request.param  # type: ignore[attr-defined]
        yield model


def check_valid(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("rule", ["topk", "threshold", "sampled"])
def test_every_answer_validates(llm: LLM, rule: str) -> None:
    """All schemas, batched in one call: 100 % parse and validate, and each ends with a stop
    id the grammar accepted (finish_reason stop, not a truncation)."""
    fields: dict = {"max_tokens": MAX_TOKENS}
    if rule == "threshold":  # commits many positions per step: the run check is exercised
        fields["confidence_threshold"] = 1e-6
    if rule == "sampled":
        fields.update(temperature=1.0, seed=7)
    for name, schema in SCHEMAS.items():
        out = llm.chat([CONVERSATION], response_format=response_format(name), **fields)[0]
        assert out.finish_reason == "stop", (name, out.text)
        check_valid(out.text, schema)


def test_runs_commit_several_tokens_per_forward(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a threshold every masked position proposes each step: the valid left-to-right run
    is kept, so some step commits more than the one grammar-masked position, and a run the
    grammar rejects part of is cut, not committed whole."""
    kept: list[tuple[int, int]] = []  # (run length offered, tokens kept) per step
    accept = Constraint.accept

    def recording(self: Constraint, run: list[int]) -> int:
        n = accept(self, run)
        kept.append((len(run), n))
        return n

    monkeypatch.setattr(Constraint, "accept", recording)
    out = llm.chat(
        [CONVERSATION],
        response_format=response_format("nested"),
        max_tokens=MAX_TOKENS,
        confidence_threshold=1e-6,
    )[0]
    check_valid(out.text, SCHEMAS["nested"])
    assert all(n >= 1 for _, n in kept)
    if llm.test_name != "llada2":  # type: ignore[attr-defined]
        # Parallel commits survive inside the grammar. (The tiny LLaDA2's unconstrained
        # proposals are mostly control bytes, never valid inside JSON, so there every run is
        # cut to its first, grammar-masked token: the guarantee holds, the parallelism not.)
        assert max(n for _, n in kept) > 1, kept
    assert any(n < offered for offered, n in kept), kept  # and invalid tails are cut


def test_batched_equals_solo(llm: LLM) -> None:
    """Constrained rows of different schemas and a free row, submitted together (one batch per
    step): each answer equals its solo run, and the constrained ones validate."""
    from dllm_serve.api.pipeline import chat_request
    from dllm_serve.offline_batch import run_together

    names = ["sum", "nested", "pattern", "array_of_objects", None]
    fields = {"max_tokens": MAX_TOKENS, "temperature": 0.7, "seed": 3}

    def request(name: str | None) -> tuple:
        extra = {} if name is None else {"response_format": response_format(name)}
        body = json.dumps({"messages": CONVERSATION, **fields, **extra}).encode()
        spec, ids = chat_request(llm._facts, body, "application/json")
        return ids, spec.params, spec.stop, spec.include_stop_str

    solo = [run_together(llm.engine, [request(n)])[0].text for n in names]
    together = [c.text for c in run_together(llm.engine, [request(n) for n in names])]
    assert together == solo
    for text, name in zip(together, names, strict=True):
        if name is not None:
            check_valid(text, SCHEMAS[name])


def test_json_object(llm: LLM) -> None:
    """json_object: any JSON object. Unbounded, so a random model may run out of max_tokens:
    then finish_reason is "length" and the text is a truncated object (as OpenAI's); otherwise
    it parses as an object."""
    out = llm.chat([CONVERSATION], response_format={"type": "json_object"}, max_tokens=48)[0]
    assert out.text.startswith("{")
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    else:
        assert out.finish_reason == "length"
        with pytest.raises(json.JSONDecodeError):
            json.loads(out.text)


def test_unconstrained_answers_do_not_parse(llm: LLM) -> None:
    """Without enforcement the same model's answer is not valid JSON for the schema (so the
    passes above are the enforcement's doing)."""
    free = llm.chat([CONVERSATION], max_tokens=MAX_TOKENS)[0].text
    with pytest.raises((json.JSONDecodeError, jsonschema.ValidationError)):
        check_valid(free, SCHEMAS["sum"])


def test_schema_compiled_once(llm: LLM) -> None:
    grammar = llm.engine.algorithm.grammar
    assert isinstance(grammar, TokenGrammar)
    rf = response_format("any_of")
    llm.chat([CONVERSATION], response_format=rf, max_tokens=MAX_TOKENS)
    before = grammar.compiles
    llm.chat([CONVERSATION, CONVERSATION], response_format=rf, max_tokens=MAX_TOKENS)
    assert grammar.compiles == before


def test_length_is_truncated_json(llm: LLM) -> None:
    """max_tokens spent before the grammar accepts: finish_reason "length", a valid prefix."""
    out = llm.chat([CONVERSATION], response_format=response_format("nested"), max_tokens=4)[0]
    assert out.finish_reason == "length"
    assert out.text.startswith('{"')


# ---- refusals ----------------------------------------------------------------------------------


def test_unsupported_schema_is_a_400_naming_it() -> None:
    with pytest.raises(GrammarError, match="not"):
        response_format_grammar(
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}
        )
    with pytest.raises(GrammarError, match="type"):
        response_format_grammar({"type": "yaml"})
    with pytest.raises(GrammarError, match="name"):
        response_format_grammar({"type": "json_schema", "json_schema": {"schema": {}}})
    assert response_format_grammar({"type": "text"}) is None
    assert response_format_grammar(None) is None


def test_api_refusals(tmp_path: Path) -> None:
    path = write_tiny_llada(tmp_path / "m")
    with LLM(str(path), device="cpu", dtype="float32") as llm:
        bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}
        with pytest.raises(InvalidRequestError, match="not") as info:
            llm.chat([CONVERSATION], response_format=bad)
        assert info.value.param == "response_format"
        with pytest.raises(InvalidRequestError, match="ignore_eos"):
            llm.chat([CONVERSATION], response_format={"type": "json_object"}, ignore_eos=True)


def test_self_speculation_refuses(tmp_path: Path) -> None:
    """I-DLM self-speculation does not apply a grammar yet: a 400, never free text."""
    path = write_tiny_idlm(tmp_path / "m")
    with LLM(str(path), device="cpu", dtype="float32") as llm:
        with pytest.raises(InvalidRequestError, match="self_speculation") as info:
            llm.chat([CONVERSATION], response_format={"type": "json_object"})
        assert info.value.code == "not_applicable"
        assert info.value.param == "response_format"


def test_lookahead_closes_what_masking_would_extend(tmp_path: Path) -> None:
    """The beam over the block window (blocks._beam_first) on synthetic log-probabilities:
    after ``{"sum":4`` position 0 prefers a digit and ``}`` is unlikely, but every later
    position wants the stop id. Plain masking (argmax at position 0) takes the digit; the
    lookahead takes ``}``, because ``}`` then EOS beats eight more unlikely digits. With a
    window of one position it is plain masking again."""
    import numpy as np

    from dllm_serve.decoding.blocks import _beam_first

    llm = LLM(str(ASSETS / "demo-llada"), device="cpu", dtype="float32")
    try:
        tokenizer, vocab = llm.loaded.tokenizer, llm.loaded.vocab_size
        stop = llm.loaded.stop_ids[0]
        grammar = TokenGrammar(tokenizer, vocab, llm.loaded.stop_ids)
        text = response_format_grammar(response_format("sum"))
        assert text is not None
        constraint = grammar.constraint(text, (stop,))
        prefix = tokenizer.encode('{"sum":4', add_special_tokens=False)
        assert constraint.accept(prefix) == len(prefix)
        nine, close = tokenizer.convert_tokens_to_ids("9"), tokenizer.convert_tokens_to_ids("}")
        log_p = np.full((8, vocab), -30.0, dtype=np.float32)
        log_p[0, nine], log_p[0, close] = -0.1, -12.0
        log_p[1:, stop] = -0.01
        log_p[1:, nine] = -5.0
        assert _beam_first(constraint, log_p, (stop,)) == close
        assert _beam_first(constraint, log_p[:1], (stop,)) == nine
        assert constraint.consumed == len(prefix)  # the request's matcher is untouched
    finally:
        llm.close()
