"""Copies of the model's tokenizer, each lent to one API worker thread at a time.

Chat templating and tokenization run in the event loop's worker threads. A Hugging Face
tokenizer object is not meant to be used by two threads at once (its Rust core refuses a
concurrent change of settings), so each call holds one copy. With a single shared copy, one
huge prompt (megabytes take seconds to tokenize) held up every other request's tokenization
behind it; with a pool, the others take another copy. Copies are made on demand, so a
server under light load holds one.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from dllm_serve.models.loader import LoadedModel

# Tokenizations at once; past it a caller waits for a copy. Each copy holds the vocabulary
# and merges again (tens of MB for a 100k-token vocabulary).
DEFAULT_TOKENIZER_COPIES = 4


class TokenizerPool:
    """Lends views of ``loaded`` that differ only in their tokenizer copy (``borrow``)."""

    def __init__(self, loaded: LoadedModel, size: int = DEFAULT_TOKENIZER_COPIES) -> None:
        if size < 1:
            raise ValueError("a tokenizer pool needs at least one copy")
        self._loaded = loaded
        self._free = [loaded]  # the first copy is the model's own tokenizer
        self._made = 1
        self._size = size
        self._cond = threading.Condition()

    @property
    def copies(self) -> int:
        """Copies made so far (≤ the pool's size)."""
        return self._made

    @contextmanager
    def borrow(self) -> Iterator[LoadedModel]:
        """A view of the model whose tokenizer no other thread uses until this returns."""
        with self._cond:
            while not self._free and self._made >= self._size:
                self._cond.wait()
            view = self._free.pop() if self._free else None
            if view is None:
                self._made += 1
        if view is None:
            try:  # copied outside the lock: the other copies stay available meanwhile
                view = dataclasses.replace(
                    self._loaded, tokenizer=copy.deepcopy(self._loaded.tokenizer)
                )
            except BaseException:
                with self._cond:
                    self._made -= 1
                    self._cond.notify()
                raise
        try:
            yield view
        finally:
            with self._cond:
                self._free.append(view)
                self._cond.notify()
