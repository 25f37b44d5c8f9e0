"""Incremental detokenization: stop strings across tokens, held-back text, partial UTF-8."""

from __future__ import annotations

from control_plane.detok import Detokenizer
from control_plane.tokenizer import ByteTokenizer

TOK = ByteTokenizer.default()


def feed(d: Detokenizer, text: str) -> list[str]:
    out = []
    for b in text.encode():
        d.push([b])
        out.append(d.delta())
    return out


def test_text_that_may_start_a_stop_string_is_held() -> None:
    d = Detokenizer(TOK, ("END",))
    assert feed(d, "abE") == ["a", "b", ""]
    assert feed(d, "x") == ["Ex"]


def test_stop_string_across_tokens_cuts_the_text() -> None:
    d = Detokenizer(TOK, ("END",))
    feed(d, "abEN")
    assert d.push([ord("D")]) and d.delta(final=True) == ""
    assert d.text == "ab"


def test_partial_utf8_is_held_until_complete() -> None:
    d = Detokenizer(TOK)
    raw = "é".encode()
    d.push([raw[0]])
    assert d.delta() == ""
    d.push([raw[1]])
    assert d.delta() == "é"


def test_final_flushes_held_text() -> None:
    d = Detokenizer(TOK, ("xyz",))
    feed(d, "ax")
    assert d.delta(final=True) == "x"
