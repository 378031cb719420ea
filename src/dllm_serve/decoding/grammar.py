"""Structured output (``response_format``): a JSON schema → a token-level prefix matcher.

Torch-free (the API imports it to validate a schema before a request is admitted). The grammar
library is llguidance (an Earley parser over the model's own tokenizer, JSON schema compiled
lazily, masks in microseconds on CPU); ``docs/structured-output.md`` says why it fits the
diffusion design and how the decoders use it.

Three pieces:

- :func:`response_format_grammar`: an OpenAI ``response_format`` → the grammar text a request
  carries in :class:`~dllm_serve.decoding.params.DecodingParams` (``grammar``), or None for
  plain text. A schema the library cannot compile raises :class:`GrammarError` naming the
  unsupported feature (the API's 400).
- :class:`TokenGrammar`: one per served model: the llguidance tokenizer (built on first use)
  and a cache of compiled matchers keyed by grammar text, so a schema is compiled once and
  every request of it starts from a copy.
- :class:`Constraint`: one per request: the matcher of the answer's committed prefix. The
  decoders ask it for the allowed-token bitmask of the next position and hand it each run
  of committed tokens; it accepts the longest valid prefix of a run and never a token that
  could not continue to a string of the language.
"""

from __future__ import annotations

import functools
import json
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import llguidance

# Compact JSON: no free whitespace between tokens. With flexible whitespace a weak model can
# spend its whole budget on blanks that every JSON parser accepts and no client wants.
_JSON_OPTIONS = {"whitespace_flexible": False}
_CACHE_SIZE = 64  # compiled schemas kept per model (least recently used dropped)


class GrammarError(ValueError):
    """A ``response_format`` that cannot be enforced (message names the reason)."""


def response_format_grammar(response_format: Any) -> str | None:
    """The grammar text for an OpenAI ``response_format``, or None for plain text.

    ``{"type": "text"}`` (or nothing) → None; ``{"type": "json_object"}`` → any JSON object;
    ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}}``
    → the schema (enforced whatever ``strict`` says: enforcement is this server's only mode).
    Raises :class:`GrammarError` for a malformed value or a schema llguidance cannot compile.
    """
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise GrammarError("'response_format' must be an object with a 'type'.")
    kind = response_format.get("type")
    extra = set(response_format) - {"type", "json_schema"}
    if extra:
        raise GrammarError(f"'response_format' has unknown fields {sorted(extra)}.")
    if kind == "text":
        if "json_schema" in response_format:
            raise GrammarError("'json_schema' goes with type 'json_schema', not 'text'.")
        return None
    if kind == "json_object":
        if "json_schema" in response_format:
            raise GrammarError("'json_schema' goes with type 'json_schema', not 'json_object'.")
        return schema_grammar({"type": "object"})
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise GrammarError("type 'json_schema' needs a 'json_schema' object.")
        unknown = set(spec) - {"name", "schema", "strict", "description"}
        if unknown:
            raise GrammarError(f"'json_schema' has unknown fields {sorted(unknown)}.")
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            raise GrammarError("'json_schema.name' must be a non-empty string.")
        if not isinstance(spec.get("strict", False), bool | None):
            raise GrammarError("'json_schema.strict' must be a boolean.")
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise GrammarError("'json_schema.schema' must be a JSON Schema object.")
        return schema_grammar(schema)
    raise GrammarError(
        f"response_format type {kind!r} is not supported: use 'text', 'json_object' or "
        "'json_schema'."
    )


def schema_grammar(schema: dict[str, Any]) -> str:
    """llguidance's grammar text for a JSON ``schema`` (compact whitespace), validated: a
    schema keyword it does not implement raises :class:`GrammarError` with its message (for
    example ``Unimplemented keys: ["not"]``). Cached by the schema's text, so the API's checks
    and the request's parameters validate a schema once."""
    try:
        key = json.dumps(schema, sort_keys=True)
    except (TypeError, ValueError, RecursionError) as exc:
        raise GrammarError(f"the JSON schema cannot be read: {exc}") from exc
    return _schema_grammar(key)


@functools.lru_cache(maxsize=256)
def _schema_grammar(key: str) -> str:
    # Our whitespace option goes in unless the schema sets its own x-guidance options.
    own = json.loads(key)
    own.setdefault("x-guidance", dict(_JSON_OPTIONS))
    return _checked("the JSON schema", llguidance.LLMatcher.grammar_from_json_schema, own)


def tool_call_grammar(
    call_schema: dict[str, Any], parallel: bool, markers: tuple[int, int] | None
) -> str:
    """The grammar of a ``tool_choice: "auto"`` answer in the hermes format: plain text that
    never contains ``<tool_call>``, or text followed by one call (``parallel``: one or more,
    a newline apart), each ``<tool_call>\\n{JSON}\\n</tool_call>`` whose JSON matches
    ``call_schema`` (one of the tools' ``{"name", "arguments"}``), and nothing after the calls.
    So the answer is text, or calls the hermes parser reads whole, never a broken call.

    ``markers``: the ids of ``<tool_call>`` and ``</tool_call>`` where the tokenizer has them
    as single tokens (Qwen's vocabularies, which encode the text as those tokens and which
    llguidance treats as special tokens); None: the markers are spelled as text. Cached by
    the schema's text, as :func:`schema_grammar` is: an agent sends the same tools with every
    turn, and the API builds this on its request path."""
    try:
        key = json.dumps(call_schema)  # key order kept: it is the order the JSON is written in
    except (TypeError, ValueError, RecursionError) as exc:
        raise GrammarError(f"the tools' schemas cannot be read: {exc}") from exc
    return _tool_call_grammar(key, parallel, markers)


@functools.lru_cache(maxsize=256)
def _tool_call_grammar(key: str, parallel: bool, markers: tuple[int, int] | None) -> str:
    schema = json.loads(key)
    schema.setdefault("x-guidance", dict(_JSON_OPTIONS))
    call_json = "%json " + json.dumps(schema)
    text = "TEXT: /(.|\\n)*/ & ~/(.|\\n)*<tool_call>(.|\\n)*/"
    if markers is not None:
        opening, closing = markers
        call = f'call: <[{opening}]> "\\n" {call_json} "\\n" <[{closing}]>'
        more = ' ("\\n" call)*' if parallel else ""
        rules = [f"start: TEXT | TEXT? call{more}", call, text]
    else:
        # The opening marker ends the text's lexeme (TEXT then "<tool_call>" in one lexeme),
        # so the lexer never has to split text from a marker it could also be part of.
        more = " (SEP call)*" if parallel else ""
        rules = [
            f"start: TEXT | OPEN call{more}",
            f'call: {call_json} "\\n</tool_call>"',
            'OPEN: TEXT "<tool_call>\\n"',
            'SEP: "\\n<tool_call>\\n"',
            text,
        ]
    lark = "\n".join(rules) + "\n"
    return _checked("the tools' schemas", llguidance.LLMatcher.grammar_from_lark, lark)


def _checked(what: str, build: Any, source: Any) -> str:
    """llguidance's grammar text from ``build(source)``, validated; a :class:`GrammarError`
    naming ``what`` and llguidance's reason when it cannot be compiled or enforced."""
    try:
        grammar = build(source)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise GrammarError(f"{what} cannot be compiled: {exc}") from exc
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(f"{what} cannot be enforced: {error}")
    return grammar


def request_constraint(
    compiler: TokenGrammar | None, grammar: str | None, stop_ids: Sequence[int]
) -> Constraint | None:
    """The matcher of a request's ``grammar`` (None: free text) with its stop set; a decoder
    without a ``compiler`` (structured output refused) or a request without a stop id (its
    answer could never end) is a ValueError."""
    if grammar is None:
        return None
    if compiler is None:
        raise ValueError("this decoder does not enforce structured output")
    if not stop_ids:
        raise ValueError("structured output needs a stop id to end the answer")
    return compiler.constraint(grammar, stop_ids)


def grammar_key(grammar: str) -> str:
    """A stable key of a grammar text (its canonical JSON), for caches and logs."""
    try:
        return json.dumps(json.loads(grammar), sort_keys=True, separators=(",", ":"))
    except ValueError:
        return grammar


class TokenGrammar:
    """Compiles grammars against one model's tokenizer; one per served model.

    ``vocab_size`` is the model's (the embedding's rows; it may exceed the tokenizer's list, and
    ids past it are never allowed). ``stop_ids`` are the model's EOS/EOT ids: the grammar's own
    end-of-sequence is replaced by each request's stop set (:meth:`Constraint.allowed_bits`).
    Compiled matchers are cached by grammar text (:data:`_CACHE_SIZE` of them), so a schema is
    compiled once and every request of it starts from a copy of the compiled matcher.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int]) -> None:
        self._hf = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = tuple(stop_ids)
        self._ll: Any = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self.compiles = 0  # grammars compiled (cache misses), for tests and metrics

    @property
    def ll_tokenizer(self) -> Any:
        """The llguidance tokenizer (built on first use: the vocabulary's byte strings)."""
        if self._ll is None:
            import llguidance.hf

            try:
                self._ll = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size)
            except Exception as exc:  # e.g. a tokenizer whose decoder it cannot classify
                raise GrammarError(
                    f"structured output: llguidance cannot read this model's tokenizer: {exc}"
                ) from exc
        return self._ll

    def constraint(self, grammar: str, stop_ids: Sequence[int]) -> Constraint:
        """A fresh matcher of ``grammar`` for one request with stop set ``stop_ids``."""
        key = grammar_key(grammar)
        template = self._compiled.get(key)
        if template is None:
            template = llguidance.LLMatcher(self.ll_tokenizer, grammar)
            if template.is_error():
                raise GrammarError(f"the grammar cannot be compiled: {template.get_error()}")
            self.compiles += 1
            self._compiled[key] = template
            if len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        ends = set(self.stop_ids) | {int(self.ll_tokenizer.eos_token)}
        return Constraint(template.deep_copy(), self.vocab_size, ends, tuple(stop_ids))


class Constraint:
    """The matcher of one request's committed answer prefix.

    Invariant: every token handed to :meth:`accept` and kept is a valid continuation of the
    prefix, so the prefix always extends to at least one string of the language; a stop id is
    kept only where the prefix is itself a complete string (the matcher accepts).
    """

    def __init__(
        self, matcher: Any, vocab_size: int, ends: set[int], stop_ids: tuple[int, ...]
    ) -> None:
        self._m = matcher
        self.vocab_size = vocab_size
        self._ends = ends  # every end-of-sequence id the grammar or model knows
        self.stop_ids = stop_ids  # this request's stop set
        self.done = False  # a stop id was accepted: the answer is complete
        self.consumed = 0  # answer tokens consumed (the committed prefix's length)

    @property
    def accepting(self) -> bool:
        """Whether the committed prefix is a complete string of the language."""
        return bool(self._m.is_accepting())

    def allowed_bits(self) -> bytes:
        """The next position's allowed tokens as a little-endian bitmask of
        ``ceil(vocab_size / 32)`` 32-bit words: the grammar's tokens without any end id, plus
        the request's stop ids where the prefix is complete. Never empty while the answer is
        open (a stopped grammar accepts, so its stop ids remain)."""
        bits = bytearray(self._m.compute_bitmask())
        for token in self._ends:
            if token < len(bits) * 8:
                bits[token >> 3] &= ~(1 << (token & 7)) & 0xFF
        if self._m.is_accepting():
            for token in self.stop_ids:
                bits[token >> 3] |= 1 << (token & 7)
        return bytes(bits)

    def allows(self, token: int) -> bool:
        """Whether ``token`` may come next (:meth:`allowed_bits` for one token)."""
        if token in self._ends and token not in self.stop_ids:
            return False
        if token in self.stop_ids:
            return bool(self._m.is_accepting())
        return self._m.validate_tokens([token]) == 1

    def fork(self) -> Constraint:
        """An independent copy (the lookahead's beams advance copies, never the request's)."""
        twin = Constraint(self._m.deep_copy(), self.vocab_size, self._ends, self.stop_ids)
        twin.done, twin.consumed = self.done, self.consumed
        return twin

    def completes_with(self, token: int) -> bool:
        """Whether the prefix followed by ``token`` (allowed now) is a complete string, so a
        stop id may come next; the matcher is left as it was."""
        if not self._m.consume_token(int(token)):
            raise RuntimeError(f"grammar matcher rejected token {token}: {self._m.get_error()}")
        try:
            return bool(self._m.is_accepting()) and bool(self.stop_ids)
        finally:
            self._m.rollback(1)

    def accept(self, run: Sequence[int]) -> int:
        """Consume the longest valid prefix of ``run`` (a stop id is valid where the prefix
        is complete, and ends the answer); returns how many tokens were kept."""
        if self.done:
            return 0
        body: list[int] = []
        for token in run:
            if token in self.stop_ids or token in self._ends:
                break
            body.append(int(token))
        kept = self._m.validate_tokens(body) if body else 0
        if kept:
            consumed = self._m.consume_tokens(body[:kept])
            if consumed is False or self._m.is_error():  # cannot happen after validate_tokens
                error = self._m.get_error()
                raise RuntimeError(f"grammar matcher rejected a validated run: {error}")
        self.consumed += kept
        if kept == len(body) and kept < len(run):
            stop = run[kept]
            if stop in self.stop_ids and self._m.is_accepting():
                self.done = True
                return kept + 1
        return kept
