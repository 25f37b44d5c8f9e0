"""Incremental detokenization: stop strings across tokens, held-back text, partial UTF-8."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from control_plane.text.detok import Detokenizer, Tokenizer
from control_plane.text.tokenizer import ByteTokenizer, load_tokenizer
from protos.defaults import DEFAULT_MODEL_DIR
from tools.bench.detok import ScanDetokenizer, measure_stops

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


class FullDecode:
    """The reference: the whole output decoded again at every step."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...]) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.longest = max((len(s) for s in stop), default=0)
        self.ids: list[int] = []
        self.text, self.sent, self.stopped = "", 0, False

    def push(self, ids: list[int], check_stop: bool = True) -> bool:
        self.ids.extend(ids)
        self.text = self.tokenizer.decode(self.ids)
        if check_stop:
            start = max(0, self.sent - self.longest)
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
        return self.stopped

    def delta(self, final: bool = False) -> str:
        end = len(self.text)
        if not final and not self.stopped:
            end -= Detokenizer(self.tokenizer, self.stop)._held(self.text)
        out = self.text[self.sent : max(end, self.sent)]
        self.sent += len(out)
        return out


def stream(d: Detokenizer | FullDecode, ids: list[int], early: int) -> tuple[list[str], int]:
    """Push a token at a time, in steps of 1 to 3, as the scheduler does; the deltas and the
    number of tokens taken before a stop string."""
    out, i, rng = [], 0, random.Random(len(ids))
    while i < len(ids):
        for t in ids[i : i + rng.randint(1, 3)]:
            i += 1
            if d.push([t], check_stop=i > early):
                return [*out, d.delta(final=True)], i
        out.append(d.delta())
    return [*out, d.delta(final=True)], i


HF = load_tokenizer(DEFAULT_MODEL_DIR)
PIECES = ["a", "b", " ab", "ba", "é", "日本", "\U0001f600", "abc"]


def random_ids(tokenizer: Tokenizer, seed: int, n: int) -> list[int]:
    """Text pieces, broken UTF-8 and special ids, tokenized piece by piece."""
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < n:
        r = rng.random()
        if r < 0.1:
            ids.extend(rng.choice(["日".encode(), b"\xff", b"\xe2\x82"]))
        elif r < 0.15:
            ids.append(rng.choice([256, 257]))
        else:
            ids.extend(tokenizer.encode(rng.choice(PIECES)))
    return ids[:n]


@dataclass
class CountingTokenizer:
    """A tokenizer without a stream of its own; counts the ids it decodes."""

    inner: Tokenizer
    decoded: int = 0

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text)

    def decode(self, ids: list[int]) -> str:
        self.decoded += len(ids)
        return self.inner.decode(ids)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("kind", ["byte", "hf", "byte-window", "hf-window"])
def test_streaming_matches_full_decoding(kind: str, seed: int) -> None:
    tokenizer: Tokenizer = HF if kind.startswith("hf") else TOK
    if kind.endswith("window"):
        tokenizer = CountingTokenizer(tokenizer)
    ids = random_ids(tokenizer, seed, 2000)
    stop = () if seed % 3 == 0 else ("aab", "日é")
    early = 0 if seed % 2 else 40
    assert stream(Detokenizer(tokenizer, stop), ids, early) == stream(
        FullDecode(tokenizer, stop), ids, early
    )


def test_streams_never_decode_the_whole_output(monkeypatch: pytest.MonkeyPatch) -> None:
    for tokenizer in (TOK, HF):
        ids = random_ids(tokenizer, 0, 2000)
        monkeypatch.setattr(type(tokenizer), "decode", None)  # a call would raise
        assert stream(Detokenizer(tokenizer, ("aab",)), ids, len(ids))[1] == len(ids)


@pytest.mark.parametrize("tokenizer", [TOK, HF], ids=["byte", "hf"])
def test_the_window_fallback_decodes_a_bounded_window(tokenizer: Tokenizer) -> None:
    ids = random_ids(tokenizer, 0, 2000)
    counting = CountingTokenizer(tokenizer)
    assert stream(Detokenizer(counting, ("aab",)), ids, len(ids))[1] == len(ids)
    assert counting.decoded <= 10 * len(ids)  # ids decoded, over all the calls


def test_the_detokenization_benchmark_streams_exactly() -> None:
    """`python -m tools.bench.detok` at small lengths: it checks each stream
    against the whole decode before it times anything."""
    from tools.bench.detok import measure

    rows = measure(HF, lengths=(50, 100), repeats=1)
    assert [r["tokens"] for r in rows] == [50, 100]
    assert all(r["streamed_us_per_token"] > 0 for r in rows)


class Codepoints:
    """A tokenizer whose ids are code points, U+FFFD among them, with no stream of its own."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))


def run(d: Detokenizer | ScanDetokenizer, ids: list[int], early: int) -> tuple[list[str], str]:
    """`stream`, and the text left at the end."""
    return stream(d, ids, early)[0], d.text


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("kind", ["codepoints", "byte", "hf"])
@pytest.mark.parametrize("include", [False, True], ids=["cut", "include"])
def test_the_automaton_matches_the_scan_of_every_stop_string(
    kind: str, seed: int, include: bool
) -> None:
    """Random texts and stop strings (overlapping ones, U+FFFD, characters of several bytes),
    some tokens pushed before `min_new_tokens`: the same deltas and text as the search of
    every stop string at every step that the automaton replaced."""
    tokenizer: Tokenizer = {"codepoints": Codepoints(), "byte": TOK, "hf": HF}[kind]
    rng = random.Random(seed)
    alphabet = "ab\ufffd日 "
    for case in range(25):
        count = rng.choice([0, 1, 3, 40])
        stop = tuple("".join(rng.choices(alphabet, k=rng.randint(1, 6))) for _ in range(count))
        text = "".join(rng.choices(alphabet, k=rng.randint(0, 60)))
        ids = tokenizer.encode(text)
        early = rng.choice([0, 0, 5, 30])
        new = run(Detokenizer(tokenizer, stop, include), ids, early)
        assert new == run(ScanDetokenizer(tokenizer, stop, include), ids, early), (case, stop)


def test_the_stop_string_that_starts_first_wins_then_the_shortest() -> None:
    d = Detokenizer(TOK, ("bc", "abcd"))
    assert d.push(TOK.encode("zabcd")) and d.text == "z"
    d = Detokenizer(TOK, ("abc", "ab"), include_stop=True)
    assert d.push(TOK.encode("xabc")) and d.text == "xab"


def test_overlapping_stop_strings_hold_and_cut() -> None:
    d = Detokenizer(TOK, ("abcde", "cd", "aab"))
    assert feed(d, "aaabc") == ["", "", "a", "", ""]  # "aaa" holds "aa": it may become "aab"
    assert d.stopped and d.text == "a"
    d = Detokenizer(TOK, ("abcde", "cd"))
    assert feed(d, "xabc") == ["x", "", "", ""]  # "abc" may still become "abcde"
    assert d.push(TOK.encode("d")) and d.delta(final=True) == "ab"  # "cd" ends first


def test_a_stop_string_split_across_pieces_of_several_tokens() -> None:
    d = Detokenizer(TOK, ("o 日本",))
    raw = "hello 日本!".encode()
    cut = raw.index("本".encode()) + 1  # inside 本
    assert not d.push(list(raw[:cut]))
    assert d.delta() == "hell"
    assert d.push(list(raw[cut:])) and d.delta(final=True) == "" and d.text == "hell"


def test_the_stop_strings_benchmark_streams_exactly() -> None:
    """`python -m tools.bench.detok`'s stop strings case, small: each method's text is checked
    against the decoded text before anything is timed."""
    rows = measure_stops(HF, counts=(1, 4), tokens=60, repeats=1)
    assert [r["stops"] for r in rows] == [1, 4]
    assert all(r["automaton_us_per_token"] > 0 and r["build_ms"] > 0 for r in rows)
