"""Structured output (response_format) is enforced: every answer of a random-weight model parses
and validates against its schema, in canvas denoising (tiny LLaDA, tiny Dream, demo-llada),
block diffusion (tiny LLaDA2.x), self-speculation and DiffusionGemma's renoise sampler, under
top-k and threshold commits, greedy and sampled; batched answers equal solo ones."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
import torch
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
    write_tiny_fastdllm,
    write_tiny_idlm,
    write_tiny_llada,
    write_tiny_llada2,
    write_tiny_nemotron,
)

ASSETS = Path(__file__).resolve().parents[3] / "src" / "dllm_serve" / "assets"
CONVERSATION = [{"role": "user", "content": "Answer in JSON."}]
MAX_TOKENS = 64  # every schema here has a valid answer far shorter than this


@pytest.fixture(
    scope="module",
    params=["llada", "dream", "llada2", "fastdllm", "trimode-diffusion", "demo-llada"],
)
def llm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    """A tiny random checkpoint of each masked-diffusion mode — LLaDA and Dream (canvas
    denoising), LLaDA2.x block 8 (block diffusion), Fast-dLLM v2 (seeded sub-blocks), a tri-mode
    model's ``diffusion`` mode (seeded causal blocks, block 8) — and the trained demo-llada."""
    from dllm_serve.config import EngineConfig

    root = Path(tmp_path_factory.mktemp(request.param))
    path = {
        "llada": lambda: write_tiny_llada(root / "m"),
        "dream": lambda: write_tiny_dream(root / "m"),
        "llada2": lambda: write_tiny_llada2(root / "m", block_size=8, seed=3),
        "fastdllm": lambda: write_tiny_fastdllm(root / "m"),
        "trimode-diffusion": lambda: write_tiny_nemotron(root / "m", block_size=8, seed=1),
        "demo-llada": lambda: ASSETS / "demo-llada",
    }[request.param]()
    config = EngineConfig(decoding_mode="diffusion" if request.param.startswith("tri") else None)
    with LLM(str(path), device="cpu", dtype="float32", engine_config=config) as model:
        model.test_name = request.param  # type: ignore[attr-defined]
        yield model


def check_valid(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


# Sampled rows also run in test_batched_equals_solo (T = 0.7); this sweep of them is -m slow.
@pytest.mark.parametrize(
    "rule", ["topk", "threshold", pytest.param("sampled", marks=pytest.mark.slow)]
)
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
    if llm.test_name in ("llada", "dream", "demo-llada"):  # type: ignore[attr-defined]
        # Parallel commits survive inside the grammar. (The tiny block models' unconstrained
        # proposals are mostly control bytes, never valid inside JSON, so there runs are cut
        # to their first, grammar-masked token: the guarantee holds, the parallelism not.)
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
    algorithm = llm.engine.algorithm
    grammar = getattr(algorithm, "modes", {}).get("diffusion", algorithm).grammar
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


# ---- self-speculation: the causal verify under the grammar ------------------------------------


@pytest.fixture(scope="module", params=["isd", "ar", "linear_spec"])
def selfspec(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LLM, dict]]:
    """A tiny random I-DLM checkpoint (ISD, stride 4) and a tiny tri-mode one decoding by
    ``ar`` or ``linear_spec`` (block 8): the modes whose verify step is causal."""
    root = Path(tmp_path_factory.mktemp(request.param))
    if request.param == "isd":
        path, fields = write_tiny_idlm(root / "m"), {}
    else:
        path = write_tiny_nemotron(root / "m", block_size=8, seed=1)
        fields = {"decoding_mode": request.param}
    with LLM(str(path), device="cpu", dtype="float32") as model:
        yield model, fields


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_self_speculation_answers_validate(selfspec: tuple[LLM, dict], temperature: float) -> None:
    llm, fields = selfspec
    for name, schema in SCHEMAS.items():
        out = llm.chat(
            [CONVERSATION],
            response_format=response_format(name),
            max_tokens=MAX_TOKENS,
            temperature=temperature,
            seed=5,
            **fields,
        )[0]
        assert out.finish_reason == "stop", (name, out.text)
        check_valid(out.text, schema)


def test_self_speculation_batched_equals_solo(selfspec: tuple[LLM, dict]) -> None:
    from dllm_serve.api.pipeline import chat_request
    from dllm_serve.offline_batch import run_together

    llm, extra = selfspec
    names = ["nested", "pattern", None, "array_of_objects"]
    fields = {"max_tokens": MAX_TOKENS, "temperature": 0.8, "seed": 11, **extra}

    def request(name: str | None) -> tuple:
        rf = {} if name is None else {"response_format": response_format(name)}
        body = json.dumps({"messages": CONVERSATION, **fields, **rf}).encode()
        spec, ids = chat_request(llm._facts, body, "application/json")
        return ids, spec.params, spec.stop, spec.include_stop_str

    solo = [run_together(llm.engine, [request(n)])[0].text for n in names]
    assert [c.text for c in run_together(llm.engine, [request(n) for n in names])] == solo


def test_constrained_self_speculation_is_constrained_ar(tmp_path: Path) -> None:
    """Exactness survives the grammar: greedy, constrained ISD at stride 4 answers token for
    token what stride 1 (plain AR under the grammar mask) answers — with drafts that are the
    AR answer's own next tokens except the last of each round (so drafts are accepted, and
    rejected where a wrong draft meets the mask) — and tri-mode ``linear_spec`` answers what
    ``ar`` answers."""
    from dllm_serve.config import EngineConfig
    from dllm_serve.decoding.selfspec import ISDecoder, ISDState

    idlm = write_tiny_idlm(tmp_path / "idlm")
    reference: dict[str, list[str]] = {}
    with LLM(str(idlm), device="cpu", dtype="float32",
             engine_config=EngineConfig(isd_stride=1)) as llm:  # fmt: skip
        for name in SCHEMAS:
            out = llm.chat([CONVERSATION], response_format=response_format(name), max_tokens=48)
            reference[name] = [out[0].text]
    oracle: dict[str, list[int]] = {}

    def record(decoder: ISDecoder, state: ISDState, verdict: list[int]) -> object:
        result = ISDecoder._commit_row(decoder, state, verdict)
        if state.finished:
            oracle[state.params.grammar or ""] = [*state.emitted, state.stop_ids[0]]
        return result

    with LLM(str(idlm), device="cpu", dtype="float32",
             engine_config=EngineConfig(isd_stride=1)) as llm:  # fmt: skip
        decoder = llm.engine.algorithm
        decoder._commit_row = lambda s, v: record(decoder, s, v)  # type: ignore[method-assign]
        for name in SCHEMAS:
            llm.chat([CONVERSATION], response_format=response_format(name), max_tokens=48)

    def drafts(state: ISDState, proposed: list[int]) -> list[int]:
        answer = oracle[state.params.grammar or ""]
        done = len(state.emitted)
        forced = answer[done : done + len(proposed)]
        forced += proposed[len(forced) :]
        if len(forced) > 1:
            forced[-1] = proposed[-1] if proposed[-1] != forced[-1] else forced[0]
        return forced

    with LLM(str(idlm), device="cpu", dtype="float32",
             engine_config=EngineConfig(isd_stride=4)) as llm:  # fmt: skip
        llm.engine.algorithm.draft_hook = drafts
        outs = {
            n: llm.chat([CONVERSATION], response_format=response_format(n), max_tokens=48)[0]
            for n in SCHEMAS
        }
    assert {n: [o.text] for n, o in outs.items()} == reference
    accepted = sum(o.accepted_drafts for o in outs.values())
    drafted = sum(o.drafted for o in outs.values())
    assert 0 < accepted < drafted, (accepted, drafted)

    tri = write_tiny_nemotron(tmp_path / "tri", block_size=8, seed=1)
    with LLM(str(tri), device="cpu", dtype="float32") as llm:
        by_mode = {}
        for mode in ("ar", "linear_spec"):
            by_mode[mode] = [
                llm.chat(
                    [CONVERSATION],
                    response_format=response_format(n),
                    max_tokens=48,
                    decoding_mode=mode,
                )[0].text
                for n in SCHEMAS
            ]
    assert by_mode["ar"] == by_mode["linear_spec"]


# ---- the other families and demos ---------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["lladamoe", "sdar", "llada2-editing-off", "demo-idlm", "demo-trimode", "llada2.2"]
)
def test_every_other_family_and_demo_validates(tmp_path: Path, name: str) -> None:
    """The families and demos the fixtures above do not load (LLaDA-MoE's canvas, SDAR's block
    diffusion, a LLaDA2.1 editing checkpoint under its non-editing rule, a LLaDA2.2 one under
    LowConfidence, the trained I-DLM and tri-mode demos in their default modes): all 11
    schemas and json_object end with stop and validate, greedy."""
    from dllm_serve_train.tiny_checkpoints import write_tiny_lladamoe, write_tiny_sdar

    path = {
        "lladamoe": lambda: write_tiny_lladamoe(tmp_path / "m"),
        "sdar": lambda: write_tiny_sdar(tmp_path / "m"),
        "llada2-editing-off": lambda: write_tiny_llada2(tmp_path / "m", block_size=8, editing=True),
        "llada2.2": lambda: write_tiny_llada2(tmp_path / "m", block_size=8, levenshtein=True),
        "demo-idlm": lambda: ASSETS / "demo-idlm",
        "demo-trimode": lambda: ASSETS / "demo-trimode",
    }[name]()
    # An editing checkpoint's preset is an editing rule, which refuses response_format: the
    # request names a plain rule instead.
    rule = {"confidence_threshold": 0.9} if name.startswith("llada2") else {}
    with LLM(str(path), device="cpu", dtype="float32") as llm:
        for schema_name, schema in SCHEMAS.items():
            out = llm.chat([CONVERSATION], response_format=response_format(schema_name),
                           max_tokens=MAX_TOKENS, **rule)[0]  # fmt: skip
            assert out.finish_reason == "stop", (schema_name, out.text)
            check_valid(out.text, schema)
        out = llm.chat([CONVERSATION], response_format={"type": "json_object"},
                       max_tokens=MAX_TOKENS, **rule)[0]  # fmt: skip
        assert out.finish_reason in ("stop", "length")
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)


# ---- DiffusionGemma ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    """A tiny random DiffusionGemma with 8-token canvases: most answers span several, so the
    matcher carries over from one projected canvas to the next."""
    from dllm_serve_train.tiny_checkpoints import write_tiny_diffusion_gemma

    root = Path(tmp_path_factory.mktemp("dg"))
    path = write_tiny_diffusion_gemma(root / "m", canvas_length=8)
    with LLM(str(path), device="cpu", dtype="float32") as model:
        yield model


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_diffusion_gemma_answers_validate(gemma: LLM, seed: int) -> None:
    """The renoise sampler's emitted canvases are projected onto the grammar: every schema's
    answer parses, validates and ends with a stop id the grammar accepted."""
    for name, schema in SCHEMAS.items():
        fields = {"max_tokens": MAX_TOKENS, "seed": seed}
        out = gemma.chat([CONVERSATION], response_format=response_format(name), **fields)[0]
        assert out.finish_reason == "stop", (name, out.text)
        check_valid(out.text, schema)
    free = gemma.chat([CONVERSATION], max_tokens=MAX_TOKENS, seed=seed)[0].text
    with pytest.raises(ValueError):
        json.loads(free)  # the random model's own answer is not JSON


def test_diffusion_gemma_batched_equals_solo_and_length(gemma: LLM) -> None:
    """Constrained rows of several schemas and a free row in one batch answer as alone; an
    answer cut by max_tokens is a valid prefix with finish_reason length."""
    from dllm_serve.api.pipeline import chat_request
    from dllm_serve.offline_batch import run_together

    names = ["sum", "nested", "pattern", None]

    def request(name: str | None) -> tuple:
        extra = {} if name is None else {"response_format": response_format(name)}
        body = {"messages": CONVERSATION, "max_tokens": MAX_TOKENS, "seed": 3, **extra}
        spec, ids = chat_request(gemma._facts, json.dumps(body).encode(), "application/json")
        return ids, spec.params, spec.stop, spec.include_stop_str

    solo = [run_together(gemma.engine, [request(n)])[0].text for n in names]
    together = [c.text for c in run_together(gemma.engine, [request(n) for n in names])]
    assert together == solo
    for text, name in zip(together, names, strict=True):
        if name is not None:
            check_valid(text, SCHEMAS[name])
    cut = gemma.chat([CONVERSATION], response_format=response_format("nested"), max_tokens=4)[0]
    assert cut.finish_reason == "length" and cut.text.startswith('{"')


def test_grammar_canvas_keeps_allowed_argmaxes_and_replaces_the_rest() -> None:
    """The projection on scripted logits (demo-llada's tokenizer): an argmax the grammar
    allows where the text cannot end is kept as is; a refused one is replaced by the best
    allowed token; a closing token goes through the lookahead, which ends the answer with the
    stop id the next position prefers; the canvas stops there."""
    from dllm_serve.decoding.params import DecodingParams
    from dllm_serve.decoding.renoise import RenoiseState, _grammar_canvas

    llm = LLM(str(ASSETS / "demo-llada"), device="cpu", dtype="float32")
    try:
        tokenizer, vocab = llm.loaded.tokenizer, llm.loaded.vocab_size
        stop = llm.loaded.stop_ids[0]
        grammar = TokenGrammar(tokenizer, vocab, llm.loaded.stop_ids)
        text = response_format_grammar(response_format("sum"))
        assert text is not None
        ids = tokenizer.encode('{"sum":4}', add_special_tokens=False)
        x = tokenizer.convert_tokens_to_ids("x")
        argmax = [*ids[:-2], x, ids[-1], x, x]  # the digit refused, the close, junk after it
        logits = torch.full((len(argmax), vocab), -20.0)
        for i, token in enumerate(argmax):
            logits[i, token] = 5.0
        logits[len(ids) - 2, ids[-2]] = 1.0  # the best token the grammar allows there: ``4``
        logits[len(ids), stop] = 4.0  # after ``}`` the model would rather end than say x
        state = RenoiseState(
            prompt=[1], params=DecodingParams(gen_length=16, steps=1),
            generator=torch.Generator(), stop_ids=(stop,), canvas_length=len(argmax),
            steps=1, entropy_bound=0.1, argmax=argmax,
            constraint=grammar.constraint(text, (stop,)), last_logits=logits,
        )  # fmt: skip
        assert _grammar_canvas(state) == [*ids, stop]
        assert state.constraint is not None and state.constraint.done
        assert state.last_logits is None
    finally:
        llm.close()


# ---- the pieces --------------------------------------------------------------------------------


def test_restrict_to_bitmasks_masks_exactly_the_unset_bits() -> None:
    """Little-endian bits of 32-bit words: token t is bit t % 8 of byte t // 8; positions not
    listed are untouched; a head wider than the mask's vocabulary is masked past it."""
    import torch

    from dllm_serve.decoding.protocol import StepLogits
    from dllm_serve.decoding.sampler import restrict_to_bitmasks

    vocab = 40
    logits = StepLogits.padded(torch.zeros(2, 2, vocab))
    allowed = [{0, 9, 31}, {3, 32}]
    masks = []
    for tokens in allowed:
        bits = bytearray(4)  # one 32-bit word: covers tokens 0-31 only
        for t in tokens:
            if t < 32:
                bits[t >> 3] |= 1 << (t & 7)
        masks.append(bytes(bits))
    out = restrict_to_bitmasks(logits, [0, 3], masks)
    assert out.flat is not None
    finite = [set(torch.isfinite(out.flat[i]).nonzero().flatten().tolist()) for i in range(4)]
    assert finite == [{0, 9, 31}, set(range(vocab)), set(range(vocab)), {3}]


def test_constraint_accepts_the_longest_valid_prefix_and_stops_only_when_complete() -> None:
    llm = LLM(str(ASSETS / "demo-llada"), device="cpu", dtype="float32")
    try:
        tokenizer, vocab = llm.loaded.tokenizer, llm.loaded.vocab_size
        stop = llm.loaded.stop_ids[0]
        text = response_format_grammar(response_format("enum"))
        assert text is not None
        grammar = TokenGrammar(tokenizer, vocab, llm.loaded.stop_ids)
        constraint = grammar.constraint(text, (stop,))
        good = tokenizer.encode('{"color":"re', add_special_tokens=False)
        bad = tokenizer.encode("x", add_special_tokens=False)
        assert not constraint.allows(stop)  # an open object cannot end
        assert constraint.accept([*good, *bad, *good]) == len(good)
        assert constraint.accept([stop]) == 0  # still open: the stop id is refused
        rest = tokenizer.encode('d"}', add_special_tokens=False)
        assert constraint.accept([*rest, stop, *bad]) == len(rest) + 1  # ends at the stop id
        assert constraint.done and constraint.accept(good) == 0
        # A second request of the same schema reuses the compiled matcher.
        before = grammar.compiles
        grammar.constraint(text, (stop,))
        assert grammar.compiles == before == 1
    finally:
        llm.close()


def test_lookahead_closes_what_masking_would_extend(tmp_path: Path) -> None:
    """The beam over the block window (structured.beam_fill) on synthetic log-probabilities:
    after ``{"sum":4`` position 0 prefers a digit and ``}`` is unlikely, but every later
    position wants the stop id. Plain masking (argmax at position 0) takes the digit; the
    lookahead fills ``}`` then EOS, which beats eight more unlikely digits. With a window of
    one position it is plain masking again."""
    import numpy as np

    from dllm_serve.decoding.structured import beam_fill

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
        # The fill: ``}`` then the stop id (its tokens are what those positions propose).
        assert beam_fill(constraint, log_p, (stop,)) == [close, stop]
        assert beam_fill(constraint, log_p[:1], (stop,)) == [nine]
        assert constraint.consumed == len(prefix)  # the request's matcher is untouched
    finally:
        llm.close()
