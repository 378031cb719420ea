"""The tokenizer pool: one huge prompt's tokenization no longer holds up everyone else's.

Found by QA: a 4 MB prompt took ~10 s to tokenize under one lock shared by every request, so
a plain "what is 2+2" waited behind it. Each call now borrows a copy of its own.
"""

from __future__ import annotations

import threading

import pytest

from dllm_serve.engine.engine import AsyncEngine
from dllm_serve.engine.tokenizer_pool import TokenizerPool
from dllm_serve.models.loader import load_model

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def loaded():  # type: ignore[no-untyped-def]
    return load_model("tiny-llada", device="cpu", dtype="float32")


def test_a_held_tokenizer_does_not_block_another_request(loaded) -> None:  # type: ignore[no-untyped-def]
    engine = AsyncEngine(loaded)
    expected = loaded.chat_prompt_ids(MESSAGES)
    with engine._tokenizers.borrow():  # a long tokenization in another worker thread
        result: list[list[int]] = []
        worker = threading.Thread(target=lambda: result.append(engine.chat_prompt_ids(MESSAGES)))
        worker.start()
        worker.join(timeout=30)
        assert not worker.is_alive(), "the second tokenization waited for the first"
    assert result == [expected]
    assert engine.prompt_ids("What is 2 + 2?") == loaded.prompt_ids("What is 2 + 2?")


def test_copies_are_made_on_demand_up_to_the_size_then_callers_wait(loaded) -> None:  # type: ignore[no-untyped-def]
    pool = TokenizerPool(loaded, size=2)
    for _ in range(3):  # one caller at a time: the model's own tokenizer serves them all
        with pool.borrow() as view:
            assert view is loaded
    assert pool.copies == 1
    with pool.borrow() as first, pool.borrow() as second:
        assert first.tokenizer is not second.tokenizer
        assert second.model is first.model  # only the tokenizer is copied
        assert second.chat_prompt_ids(MESSAGES) == first.chat_prompt_ids(MESSAGES)
        got = threading.Event()

        def third() -> None:
            with pool.borrow():
                got.set()

        waiter = threading.Thread(target=third)
        waiter.start()
        assert not got.wait(0.3), "a third caller got a copy past the pool's size"
    waiter.join(timeout=30)
    assert got.is_set() and pool.copies == 2


def test_a_failed_copy_gives_its_place_back(loaded, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    import dllm_serve.engine.tokenizer_pool as module

    pool = TokenizerPool(loaded, size=2)

    def broken(_: object) -> object:
        raise MemoryError("no room for a copy")

    with pool.borrow():
        monkeypatch.setattr(module.copy, "deepcopy", broken)
        with pytest.raises(MemoryError), pool.borrow():
            pass
        monkeypatch.undo()
        assert pool.copies == 1
        with pool.borrow() as view:  # the place is free again: a copy is made now
            assert view.tokenizer is not loaded.tokenizer
    assert pool.copies == 2


def test_the_pool_needs_a_copy() -> None:
    with pytest.raises(ValueError, match="at least one copy"):
        TokenizerPool(None, size=0)  # type: ignore[arg-type]
