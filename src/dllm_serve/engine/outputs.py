"""What the engine hands back: per-step outputs with append-only text, how they reach their
event loops, the trace events of traced requests, and the observer hooks of the metrics.

**Traces** (the playground).
Off the OpenAI path (the chat stream's ``delta.content`` stays append-only): a request
submitted with ``trace=True`` gets one event per forward in :attr:`RequestOutput.trace`,
which ``POST /v1/dllm/trace`` streams as server-sent events (docs/playground.md):

- denoising (LLaDA, Dream, block diffusion) — ``{"type": "step", "commits": [[position,
  token_id, text], ...], "replaced": [...], "masked": n, ...}``: the answer-canvas positions
  this step wrote (position 0 is the first answer position), what each held before when the
  step edited a written token (token editing; None where it filled a mask) and how many are
  still masked;
- renoise (DiffusionGemma) — ``{"type": "renoise", "canvas_index": k, "step": s, "tokens":
  [text, ...], "changed": [i, ...], "answer_tokens": n, ...}``: after each forward, the
  current canvas's argmax tokens (what the model would answer now; every position is
  re-drawn each step, none is locked), which of them changed since the previous step, and
  the answer tokens emitted so far (a canvas joins the answer when it is done);
- self-speculation (I-DLM ISD, LinearSpec) — ``{"type": "round", "drafts": [...], "accepted": j,
  "emitted": [...], ...}``: the drafts this round verified, how many were accepted and the
  tokens it emitted (accepted drafts plus the verifier's own token, except a stop token,
  which ends the answer and is not emitted).

Both carry ``nfe``, ``committed`` and ``tokens_per_forward`` so far. Tracing reads the
state's host lists only (no device access); its cost is a copy of the canvas per traced
step, so it is for watching a request, not for serving load.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from dllm_serve.decoding.blocks import CONFIDENCE_SCALE

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """One step's result for one request.

    ``delta_text`` is the text that became final in this step, contiguous with everything sent
    before it, so joining all deltas of a request gives its full answer. ``finish_reason`` is
    ``stop`` (EOS/EOT or a stop string), ``length`` (canvas full), ``abort`` or ``error`` on
    the last output, and None before.
    """

    request_id: str
    delta_text: str
    prompt_tokens: int
    completion_tokens: int
    nfe: int
    committed: int
    step: int
    block: int
    drafted: int | None = None  # self-speculation (ISD, LinearSpec): drafts verified so far
    accepted_drafts: int | None = None  # ... and accepted (None for diffusion decoding)
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    # Traced requests only (engine/outputs.py): this step's events, None otherwise.
    trace: tuple[dict, ...] | None = None
    # Requests with logprobs: one (token text, logprob, ((text, logprob), ...)) per answer
    # token that became final in this output (engine/logprobs.py), None otherwise.
    logprobs: tuple | None = None
    # Prompt tokens whose K/V came from the prefix cache (0 without a hit, or before the
    # request started).
    cached_tokens: int = 0


class IncrementalDetokenizer:
    """Turns a growing list of final answer tokens into append-only text deltas.

    Incremental (vLLM's offsets): each update decodes only a short window — the tokens from
    ``prefix_offset`` on — and keeps the part past the text of ``[prefix_offset, read_offset)``,
    so the cost per step does not grow with the answer. Decoding a window that starts a few
    tokens back, rather than at the new tokens, keeps tokenizers that treat the first token of
    a decode specially (SentencePiece's leading space) consistent.

    Text is released only once it can no longer change:

    - a prefix can end inside a multi-byte UTF-8 character (decoded as U+FFFD), so trailing
      replacement characters are held back until more tokens arrive or the request ends;
    - with ``stop`` strings, a tail that could be the start of a stop string is held back; when a
      stop string appears, the text is cut before it and :attr:`stopped` becomes true (OpenAI:
      the stop sequence is not included in the output; with ``include_stop`` — vLLM's
      ``include_stop_str_in_output`` — the text is cut after it instead).

    Either way :attr:`stop_tokens` counts the answer tokens through the stop string: the
    tokens that produced it, not those committed after it.
    """

    def __init__(
        self,
        decode: Callable[[Sequence[int]], str],
        stop: Sequence[str] = (),
        include_stop: bool = False,
    ) -> None:
        self._decode = decode
        self._stop = tuple(s for s in stop if s)
        self._include_stop = include_stop
        self._sent = ""
        self._text = ""  # decoded text of tokens[:read_offset]
        self._prefix_offset = 0  # the window starts here (vLLM's prefix_offset)
        self._read_offset = 0  # ... and its text is final up to here (read_offset)
        self._prefix_ids: list[int] = []  # tokens[prefix_offset:read_offset]
        self._prefix_text: str | None = ""
        self._num_tokens = 0
        self.stopped = False
        self.stop_tokens: int | None = None  # answer tokens through the stop string, once stopped

    @property
    def text(self) -> str:
        return self._sent

    def update(self, tokens: Sequence[int], final: bool) -> str:
        if self.stopped or (len(tokens) == self._num_tokens and not final):
            return ""
        self._num_tokens = len(tokens)
        text = self._text
        if len(tokens) > self._read_offset:
            if self._prefix_text is None:  # decoded once per window, lazily
                self._prefix_text = self._decode(self._prefix_ids) if self._prefix_ids else ""
            window = self._decode(tokens[self._prefix_offset :])
            tail = window[len(self._prefix_text) :]
            text += tail
            if tail and (final or not window.endswith("\ufffd")):
                # The window is complete: move it forward (a trailing U+FFFD may still become
                # a character when the next token arrives, so it stays in the window).
                self._text = text
                self._prefix_ids = list(tokens[self._read_offset :])
                self._prefix_offset, self._read_offset = self._read_offset, len(tokens)
                self._prefix_text = None
        # Until the request ends, a trailing U+FFFD is a character still being completed, not
        # text: no stop string may match it (a stop of "\ufffd" would cut there).
        searched = text if final else text.rstrip("\ufffd")
        hit = self._find_stop(searched)
        if hit is not None and not final and self._earlier_stop_pending(searched, hit[0]):
            hit = None  # the text stays held back (below) until that earlier one resolves
        if hit is not None:
            cut, stop_len = hit
            self.stop_tokens = self._tokens_through(tokens, text, cut + stop_len)
            end = cut + stop_len if self._include_stop else cut
            text, final, self.stopped = text[:end], True, True
        if not final:
            text = text.rstrip("\ufffd")
            text = text[: len(text) - self._stop_prefix_len(text)]
        if not text.startswith(self._sent):
            # Defensive: what was sent is already with the client, so keep it and release
            # only a new tail.
            common = _common_prefix_len(text, self._sent)
            text = self._sent + text[common:] if final else self._sent
        delta = text[len(self._sent) :]
        self._sent = text
        return delta

    def _find_stop(self, text: str) -> tuple[int, int] | None:
        """(start, length) of the earliest stop string in ``text``, or None. Of stop strings
        that start at the same place the shortest wins: it is complete first, so that is the
        one an incremental match sees, however the tokens arrive (with "= 57" and "=", text
        decoded at once and text streamed both end at "=")."""
        if not self._stop:
            return None
        # Sent text holds no stop string, so a new match can only end in the unsent tail.
        start = max(0, len(self._sent) - max(map(len, self._stop)) + 1)
        hits = [(i, len(s)) for s in self._stop if (i := text.find(s, start)) >= 0]
        return min(hits) if hits else None  # by start, then by length

    def _earlier_stop_pending(self, text: str, start: int) -> bool:
        """Whether a stop string that would start before ``start`` may still complete: some
        tail of ``text`` beginning before it is a proper prefix of a stop string. The answer
        ends before the *first occurrence* of any stop string, so a later-starting one that
        completed first must wait (with stops "= 57" and " 5", where the answer is cut must not
        depend on how many tokens each step made final)."""
        longest = max(map(len, self._stop))
        for begin in range(max(0, len(text) - longest + 1), start):
            tail = text[begin:]
            if any(len(tail) < len(stop) and stop.startswith(tail) for stop in self._stop):
                return True
        return False

    def _tokens_through(self, tokens: Sequence[int], text: str, end: int) -> int:
        """The fewest leading tokens whose text holds ``text[:end]`` (they produced the stop
        string: the usage counts them, not the tokens committed after it). A prefix that ends
        inside a multi-byte character decodes it as U+FFFD, which has the right length but
        not the character, so the search goes on until the decoded prefix holds it.
        Decodes O(log n) prefixes, once per request."""
        target = text[:end]
        lo, hi = 0, len(tokens)
        while lo < hi:
            mid = (lo + hi) // 2
            if self._decode(tokens[:mid]).startswith(target):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


# ---- delivery ----------------------------------------------------------------------------------


Sink = Callable[[RequestOutput], None]


class Outbox:
    """A step's outputs on their way to their event loops: one ``call_soon_threadsafe`` per
    loop per flush, not one per row (engine thread only)."""

    def __init__(self) -> None:
        self._items: dict[asyncio.AbstractEventLoop, list[tuple[Sink, RequestOutput]]] = {}

    def put(
        self, sink: Sink, output: RequestOutput, loop: asyncio.AbstractEventLoop | None
    ) -> None:
        """Queue ``output`` for ``sink`` on ``loop``; without a loop (a synchronous consumer:
        tests, the offline LLM) ``sink`` runs now, on the engine thread, and must return at
        once."""
        if loop is None:
            try:
                sink(output)
            except Exception:  # the consumer's fault: the engine and the other rows go on
                logger.exception("a synchronous output sink raised")
        else:
            self._items.setdefault(loop, []).append((sink, output))

    def flush(self) -> None:
        """Hand every queued output to its event loop."""
        items, self._items = self._items, {}
        for loop, outputs in items.items():
            # A closed loop means nobody is listening any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_deliver, outputs)


def _deliver(items: list[tuple[Sink, RequestOutput]]) -> None:
    """Runs on the event loop: put each output in its request's queue."""
    for sink, output in items:
        sink(output)


# ---- traces ------------------------------------------------------------------------------------


Snapshot = tuple[Any, ...]


def snapshot(state: Any, row: Sequence[int] = (), width: int = 0) -> Snapshot:
    """What :func:`step_event` compares against after the step (taken before the commit):
    the answer canvas, and the confidence of each masked position when the step's ``row``
    carries them after its ``width`` tokens (``BlockDecoder.sample``)."""
    if hasattr(state, "emitted"):  # self-speculation
        return ("round", list(state.specs), state.accepted_drafts, len(state.emitted))
    if hasattr(state, "canvas_length"):  # DiffusionGemma's renoise canvases
        return ("renoise", list(state.argmax), state.block)
    confidence = {}
    # An editing row scores every editable position of its block, the others the masked ones.
    scored = state.editable if getattr(state, "editing", False) else state.masked
    if getattr(state, "report_confidence", False) and len(row) >= width + len(scored):
        base = state.prompt_len
        confidence = {pos - base: row[width + j] / CONFIDENCE_SCALE for j, pos in enumerate(scored)}
    return ("step", state.tokens[state.prompt_len :], confidence)


def step_event(state: Any, before: Snapshot, piece: Callable[[int], str]) -> dict[str, Any]:
    """The trace event of the step that led from ``before`` to ``state``; ``piece`` is one
    token's text."""
    event: dict[str, Any] = {
        "type": before[0],
        "nfe": state.nfe,
        "committed": state.committed,
        "tokens_per_forward": round(state.tokens_per_forward, 3),
    }
    if before[0] == "round":
        _, drafts, accepted_before, emitted_before = before
        event |= {
            # The forward's number, as a diffusion step's: LinearSpec's first forward only
            # drafts, so counting verified rounds would repeat 0 (drafts and emitted empty).
            "round": state.nfe,
            "drafts": [piece(t) for t in drafts],
            "accepted": state.accepted_drafts - accepted_before,
            "emitted": [piece(t) for t in state.emitted[emitted_before:]],
        }
        return event
    if before[0] == "renoise":
        _, old, canvas_before = before
        new = list(state.argmax)
        same_canvas = canvas_before == state.block and len(old) == len(new)
        event |= {
            "step": state.step,
            "canvas_index": state.block,
            "phase": state.phase,
            # The argmax canvas after this step: what the model would answer now.
            "tokens": [piece(t) for t in new],
            "changed": [i for i, (a, t) in enumerate(zip(old, new, strict=True)) if a != t]
            if same_canvas
            else list(range(len(new))),
            "answer_tokens": len(state.answer),
        }
        return event
    _, old, confidence = before
    new = state.tokens[state.prompt_len :]
    mask_id = state.mask_id
    changed = [i for i, (a, t) in enumerate(zip(old, new, strict=True)) if a != t]
    event |= {
        "step": state.nfe,
        "block": state.block,
        "commits": [[i, new[i], piece(new[i])] for i in changed],
        # The confidence each commit was made with (its rule's metric), beside ``commits``;
        # None for a token no masked position's rule committed (a block's seed).
        "confidences": [_rounded(confidence.get(i)) for i in changed],
        # Token editing: what an edited position held before (None: it was masked).
        "replaced": [None if old[i] == mask_id else piece(old[i]) for i in changed],
        "masked": sum(t == mask_id for t in new),
    }
    return event


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def start_event(state: Any) -> dict[str, Any]:
    """The first event: the shape of what the following events fill in."""
    if hasattr(state, "emitted"):
        return {"type": "start", "mode": "self_speculation", "max_tokens": state.params.gen_length}
    if hasattr(state, "canvas_length"):
        return {
            "type": "start",
            "mode": "renoise",
            "canvas": state.canvas_length,
            "max_tokens": state.params.gen_length,
            "steps": state.steps,
        }
    return {
        "type": "start",
        "mode": "diffusion",
        "canvas": len(state.tokens) - state.prompt_len - len(state.params.suffix_ids),
        "max_tokens": state.params.answer_budget,
        "block_length": getattr(state, "block_size", 0) or state.params.block_length,
        "steps": state.params.steps,
    }


# ---- observers (metrics live in api/metrics.py) ------------------------------------------------


class EngineObserver(Protocol):
    """How the engine reports what it does. The engine calls these on its own thread;
    implementations must be cheap and thread-safe."""

    def on_forward(self, rows: int, tokens: int, model_seconds: float, graphed: bool) -> None:
        """One forward: its rows, tokens fed, model time, and whether it replayed a static
        (captured) forward instead of running eagerly."""

    def on_iteration(self, busy_seconds: float) -> None: ...

    def on_first_content(self, seconds_since_arrival: float) -> None: ...

    def on_finished(self, output: RequestOutput, seconds_since_arrival: float) -> None: ...

    def on_prefix_cache(self, queried: int, hit: int) -> None:
        """A request started with the prefix cache on: its prompt tokens looked up, and the
        tokens found cached (vLLM's prefix-cache queries and hits)."""


class NullObserver:
    """The default: observe nothing."""

    def on_forward(self, rows: int, tokens: int, model_seconds: float, graphed: bool) -> None:
        pass

    def on_iteration(self, busy_seconds: float) -> None:
        pass

    def on_first_content(self, seconds_since_arrival: float) -> None:
        pass

    def on_finished(self, output: RequestOutput, seconds_since_arrival: float) -> None:
        pass

    def on_prefix_cache(self, queried: int, hit: int) -> None:
        pass
