"""What the engine hands back per step: append-only text deltas and counters."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """One step's result for one request.

    ``delta_text`` is the text that became final in this step, contiguous with everything sent
    before it, so joining all deltas of a request gives its full answer. ``finish_reason`` is
    ``stop`` (EOS/EOT), ``length`` (canvas ended), ``abort`` or ``error`` on the last output.
    """

    request_id: str
    delta_text: str
    prompt_tokens: int
    completion_tokens: int
    nfe: int
    step: int
    block: int
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None


class IncrementalDetokenizer:
    """Turns a growing list of final answer tokens into append-only text deltas.

    Decoding a prefix can end inside a multi-byte UTF-8 character (shown as U+FFFD) or, for
    some tokenizers, decode differently once more tokens follow. Text is therefore released
    only up to the last character that is stable: trailing replacement characters are held
    back until more tokens arrive or the request finishes.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._sent = ""
        self._num_tokens = 0

    @property
    def text(self) -> str:
        return self._sent

    def update(self, tokens: Sequence[int], final: bool) -> str:
        if len(tokens) == self._num_tokens and not final:
            return ""
        self._num_tokens = len(tokens)
        text = self._decode(tokens)
        if not final:
            text = text.rstrip("\ufffd")
        if not text.startswith(self._sent):
            # The tokenizer re-decoded an earlier span differently; keep what was sent
            # (it is already with the client) and release only the new tail.
            common = _common_prefix_len(text, self._sent)
            text = self._sent + text[common:] if final else self._sent
        delta = text[len(self._sent) :]
        self._sent = text
        return delta


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
