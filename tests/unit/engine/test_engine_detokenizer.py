"""IncrementalDetokenizer: append-only deltas that always join to the final text."""

from __future__ import annotations

from collections.abc import Sequence

from dllm_serve.engine.outputs import IncrementalDetokenizer


def byte_decode(ids: Sequence[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def run(chunks: list[list[int]]) -> list[str]:
    detok = IncrementalDetokenizer(byte_decode)
    tokens: list[int] = []
    deltas = []
    for i, chunk in enumerate(chunks):
        tokens += chunk
        deltas.append(detok.update(tokens, final=i == len(chunks) - 1))
    return deltas


def test_ascii_deltas_join_to_text() -> None:
    deltas = run([list(b"Hel"), list(b"lo"), [], list(b" world")])
    assert deltas == ["Hel", "lo", "", " world"]


def test_incomplete_utf8_is_held_back_until_complete() -> None:
    euro = list("€".encode())  # 3 bytes
    deltas = run([[*list(b"a"), euro[0]], [euro[1]], [euro[2], *list(b"b")]])
    assert deltas == ["a", "", "€b"]
    assert "".join(deltas) == "a€b"


def test_invalid_bytes_are_released_at_the_end() -> None:
    deltas = run([[*list(b"x"), 255], []])
    assert deltas == ["x", "\ufffd"]
    assert "".join(deltas) == byte_decode([*list(b"x"), 255])


def test_unchanged_tokens_give_empty_delta_without_decoding() -> None:
    calls = []

    def decode(ids: Sequence[int]) -> str:
        calls.append(list(ids))
        return byte_decode(ids)

    detok = IncrementalDetokenizer(decode)
    assert detok.update([104, 105], final=False) == "hi"
    assert detok.update([104, 105], final=False) == ""
    assert len(calls) == 1
    assert detok.update([104, 105], final=True) == ""
    assert detok.text == "hi"


def test_redecoding_never_rewrites_sent_text() -> None:
    # A tokenizer that changes its mind about an earlier span once more tokens follow.
    texts = {(1,): "ab", (1, 2): "aXc", (2,): "c"}
    detok = IncrementalDetokenizer(lambda ids: texts[tuple(ids)])
    first = detok.update([1], final=False)
    second = detok.update([1, 2], final=True)
    assert first == "ab"
    assert (first + second).startswith("ab")
    assert detok.text == first + second


def run_stop(chunks: list[str], stop: tuple[str, ...]) -> tuple[list[str], bool]:
    detok = IncrementalDetokenizer(lambda ids: bytes(ids).decode(), stop=stop)
    tokens: list[int] = []
    deltas = []
    for i, chunk in enumerate(chunks):
        tokens += list(chunk.encode())
        deltas.append(detok.update(tokens, final=i == len(chunks) - 1))
        if detok.stopped:
            break
    return deltas, detok.stopped


def test_stop_string_cuts_the_answer_and_is_not_included() -> None:
    deltas, stopped = run_stop(["Hello wor", "ld. END here", " more"], ("END",))
    assert stopped
    assert "".join(deltas) == "Hello world. "


def test_possible_stop_prefix_is_held_back_then_released() -> None:
    deltas, stopped = run_stop(["abc#", "#x", "y"], ("###",))
    assert not stopped
    assert deltas == ["abc", "##x", "y"]


def test_stop_split_across_steps_and_earliest_of_several() -> None:
    deltas, stopped = run_stop(["one tw", "o three"], ("three", "two"))
    assert stopped and "".join(deltas) == "one "


def test_stop_prefix_at_the_end_is_released_when_final() -> None:
    deltas, stopped = run_stop(["value: <", "/"], ("</end>",))
    assert not stopped and "".join(deltas) == "value: </"


def test_each_update_decodes_a_short_window_not_the_whole_answer() -> None:
    calls: list[int] = []

    def decode(ids: Sequence[int]) -> str:
        calls.append(len(ids))
        return byte_decode(ids)

    detok = IncrementalDetokenizer(decode)
    tokens: list[int] = []
    text = ""
    for i in range(200):
        tokens += list(b"ab")
        text += detok.update(tokens, final=i == 199)
    assert text == "ab" * 200
    assert max(calls) <= 4  # the previous step's tokens and this step's, never all 400


def test_stop_tokens_count_through_the_stop_string_not_after_it() -> None:
    detok = IncrementalDetokenizer(lambda ids: bytes(ids).decode(), stop=("END",))
    tokens = list(b"Hello END and more")  # one token per byte
    assert detok.update(tokens, final=False) == "Hello "
    assert detok.stopped and detok.stop_tokens == len(b"Hello END")


def test_include_stop_keeps_the_stop_string_and_counts_the_same_tokens() -> None:
    for include in (False, True):
        detok = IncrementalDetokenizer(
            lambda ids: bytes(ids).decode(), stop=("END",), include_stop=include
        )
        tokens = list(b"Hello E")
        first = detok.update(tokens, final=False)
        tokens += list(b"ND and more")  # the stop string completes in a later step
        second = detok.update(tokens, final=False)
        assert first == "Hello "  # "E" could start the stop string: held back either way
        assert second == ("END" if include else "")
        assert detok.stopped and detok.stop_tokens == len(b"Hello END")
        assert detok.update(tokens + list(b"!"), final=True) == ""  # nothing after the stop


def test_a_stop_ending_in_a_multibyte_character_counts_all_its_bytes() -> None:
    """Found by QA: the count stopped at the character's first byte token (its partial decode,
    U+FFFD, already has the right length), so usage undercounted."""
    for include in (False, True):
        detok = IncrementalDetokenizer(byte_decode, stop=("你",), include_stop=include)
        tokens = list("a你b".encode())  # one token per byte: a, 3 bytes of 你, b
        assert detok.update(tokens, final=False) == ("a你" if include else "a")
        assert detok.stopped and detok.stop_tokens == 4


def test_a_character_being_completed_never_matches_a_replacement_character_stop() -> None:
    """Found by QA: a stop of U+FFFD matched the placeholder of a character whose bytes had not
    all arrived, cutting an answer that holds no invalid byte."""
    detok = IncrementalDetokenizer(byte_decode, stop=("\ufffd",))
    tokens = list("a你b".encode())
    assert detok.update(tokens[:2], final=False) == "a" and not detok.stopped
    assert detok.update(tokens, final=True) == "你b" and not detok.stopped
    real = IncrementalDetokenizer(byte_decode, stop=("\ufffd",))  # an invalid byte does stop
    assert real.update([*b"x", 255, *b"y"], final=False) == "x" and real.stopped


def test_overlapping_stops_cut_at_the_first_occurrence_however_the_steps_split() -> None:
    """Found by QA: with "= 57" and " 5", the answer was cut at " 5" when the step that made
    "= 5" final came before the one that completed "= 57", else at "= 57"."""
    answer = list(b"123 + 456 = 579")
    for size in range(1, len(answer) + 1):
        detok = IncrementalDetokenizer(byte_decode, stop=("= 57", " 5"))
        text, sent = "", 0
        while sent < len(answer) and not detok.stopped:
            sent = min(sent + size, len(answer))
            text += detok.update(answer[:sent], final=sent == len(answer))
        assert text == "123 + 456 ", size
        assert detok.stop_tokens == len(b"123 + 456 = 57"), size


def test_of_stops_starting_at_the_same_place_the_shortest_wins_however_the_steps_split() -> None:
    """Found by review: with "= 57" and "=" (either order) and include_stop_str_in_output, the
    text was "x = 57" when the tokens arrived at once and "x =" one by one, and the usage
    counted 6 or 3 tokens. The shorter stop is complete first, so it is the one that ends."""
    answer = list(b"x = 57")
    for stops in (("= 57", "="), ("=", "= 57")):
        for include in (False, True):
            for size in range(1, len(answer) + 1):
                detok = IncrementalDetokenizer(byte_decode, stop=stops, include_stop=include)
                text, sent = "", 0
                while sent < len(answer) and not detok.stopped:
                    sent = min(sent + size, len(answer))
                    text += detok.update(answer[:sent], final=sent == len(answer))
                assert text == ("x =" if include else "x "), (stops, include, size)
                assert detok.stop_tokens == 3, (stops, include, size)
