"""Incremental detokenization with stop strings: text is released only once it can no longer
become part of a stop string, and never with a half-decoded character at its end.

Each token is decoded once, by the tokenizer's `TextStream` (or a short window of ids for a
tokenizer without one), so a step costs the same however long the output already is. Each
character is read once by an automaton over the stop strings (`StopStrings`), so a step also
costs the same however many stop strings the request sent."""

from __future__ import annotations

from array import array
from functools import lru_cache
from typing import Protocol

REPLACEMENT = "\ufffd"
_REPLACEMENT = ord(REPLACEMENT)
CHARS = 0x110000  # code points: the automaton's edge keys count in these


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


class TextStream(Protocol):
    def step(self, token_id: int) -> str:
        """The text this token completes; "" while a character is still incomplete."""
        ...

    def flush(self) -> str:
        """The text of the tokens still held for an incomplete character, broken UTF-8
        replaced, when the output ends; afterwards nothing is held."""
        ...


class WindowStream:
    """Any tokenizer's text, decoded over the ids since the last step that completed text
    and the step before it (the method of `tokenizers`' DecodeStream)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = ""  # decode(self.ids[: self.start])
        self.start = 0

    def step(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids)
        if len(text) <= len(self.prefix) or text.endswith(REPLACEMENT):
            return ""
        new, start = text[len(self.prefix) :], len(self.ids) - self.start
        self.ids = self.ids[self.start :]
        self.prefix, self.start = self.tokenizer.decode(self.ids), start
        return new

    def flush(self) -> str:
        text, prefix = self.tokenizer.decode(self.ids), self.prefix
        self.prefix = text
        return text[len(prefix) :] if text.startswith(prefix) else ""


def text_stream(tokenizer: Tokenizer) -> TextStream:
    """The tokenizer's own stream when it has one."""
    make = getattr(tokenizer, "stream", None)
    return make() if make is not None else WindowStream(tokenizer)


class StopStrings:
    """Aho-Corasick over a request's stop strings. A state is a node of their trie: the
    longest end of the text read so far that begins some stop string. A character costs
    amortized O(1) whatever the number of stop strings; the build is linear in their total
    length (sorting aside), and a node keeps about 100 bytes."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.edges: dict[int, int] = {}  # node * CHARS + code point -> child
        parent, char, depth = array("i", [0]), array("i", [0]), array("i", [0])
        ends, inner = set(), bytearray(1)  # nodes that end a stop string; nodes with children
        for s in stops:
            node = 0
            for c in s:
                key = node * CHARS + ord(c)
                child = self.edges.get(key)
                if child is None:
                    child = self.edges[key] = len(depth)
                    parent.append(node)
                    char.append(ord(c))
                    depth.append(depth[node] + 1)
                    inner[node] = 1
                    inner.append(0)
                node = child
            ends.add(node)
        zeros = bytes(4 * len(depth))
        self.fail = array("i", zeros)  # the node of the longest proper end of the node's text
        self.found = array("i", zeros)  # the longest stop string its text ends with; 0: none
        self.held = array("i", zeros)  # its text's longest end that a stop string goes on from
        for node in sorted(range(1, len(depth)), key=depth.__getitem__):  # shallow ones first
            up = parent[node]
            fail = self.fail[node] = self.step(self.fail[up], char[node]) if up else 0
            self.found[node] = depth[node] if node in ends else self.found[fail]
            self.held[node] = depth[node] if inner[node] else self.held[fail]

    def step(self, state: int, c: int) -> int:
        """The state after code point `c`."""
        while state and state * CHARS + c not in self.edges:
            state = self.fail[state]
        return self.edges.get(state * CHARS + c, 0)

    def read(self, state: int, text: str) -> tuple[int, int | None, tuple[int, int] | None]:
        """`text` read from `state`: the state after it, the state after its last character
        that is not U+FFFD (None: it has none), and the stop string that starts first among
        those ending inside it (the shortest on a tie), as offsets into `text` (its start is
        negative when it began before `text`; None: no stop string ends inside it)."""
        body, hit = None, None
        for end, c in enumerate(map(ord, text), 1):
            state = self.step(state, c)
            if c != _REPLACEMENT:
                body = state
            n = self.found[state]
            if n and (hit is None or end - n < hit[0]):
                hit = (end - n, end)
        return state, body, hit


def stop_strings(stop: tuple[str, ...]) -> StopStrings:
    """The automaton of `stop`'s strings (an empty one stops nothing). One is kept for each
    distinct tuple: admission builds a request's (`control_plane.admission.bounds`), and its
    `Detokenizer` on the scheduler's thread finds it built, as do later requests that send the
    same strings (a client's usual case)."""
    return _automaton(tuple(s for s in stop if s))


@lru_cache(maxsize=64)
def _automaton(stop: tuple[str, ...]) -> StopStrings:
    return StopStrings(stop)


class Detokenizer:
    """Released text lives in `parts`; `pending` is decoded text not yet released. Every
    character decoded is read once by the stop strings' automaton, whose state says how much
    of the text's end may still become a stop string (`_hold`). Text added without a stop
    check (before `min_new_tokens`, or the final flush) is searched once more, with the last
    `longest` released characters, at the next check, as vLLM searches it."""

    def __init__(
        self, tokenizer: Tokenizer, stop: tuple[str, ...] = (), include_stop: bool = False
    ) -> None:
        self.stream = text_stream(tokenizer)
        self.stop = tuple(s for s in stop if s)
        self.stops = stop_strings(stop)
        self.include_stop = include_stop  # the text ends after the stop string, not before
        self.longest = max((len(s) for s in self.stop), default=0)
        self.ids: list[int] = []
        self.parts: list[str] = []
        self.tail = ""  # the last `longest` released characters
        self.pending = ""
        self.state = 0  # the automaton's, after all the text decoded
        self.body = 0  # its state after the last character that is not U+FFFD
        self.run = 0  # U+FFFD characters at the end of the text
        self.unchecked = False  # text not searched for stop strings is in `pending` or `tail`
        self.stopped = False

    @property
    def text(self) -> str:
        """All the text so far, cut before a stop string."""
        return "".join(self.parts) + self.pending

    def push(self, ids: list[int], check_stop: bool = True) -> bool:
        """Add tokens; True when a stop string now appears (the text is cut before it)."""
        self.ids.extend(ids)
        if self.stopped:
            return True
        new = "".join(self.stream.step(t) for t in ids)
        hit = self._read(new)
        if not check_stop or not self.stop:
            self.unchecked = self.unchecked or bool(new and self.stop)
            return False
        if self.unchecked:
            hit, self.unchecked = self._search_window(), False
        if hit is not None:
            cut = hit[1] if self.include_stop else hit[0]
            self.pending = self.pending[: max(cut, 0)]
            self.stopped = True
        return self.stopped

    def delta(self, final: bool = False) -> str:
        """The text not yet released that is safe to release now (all of it when final)."""
        if final and not self.stopped:
            flushed = self.stream.flush()
            self._read(flushed)
            self.unchecked = self.unchecked or bool(flushed and self.stop)
        out = self.pending
        if not final and not self.stopped:
            out = out[: max(0, len(out) - self._hold())]
        self.pending = self.pending[len(out) :]
        if out:
            self.parts.append(out)
            self.tail = (self.tail + out)[-self.longest :] if self.longest else ""
        return out

    def _read(self, new: str) -> tuple[int, int] | None:
        """Append `new` to `pending` through the automaton; the first stop string ending in
        it, as offsets into `pending`."""
        stripped = len(new.rstrip(REPLACEMENT))
        self.run = self.run + len(new) if not stripped else len(new) - stripped
        at, hit = len(self.pending), None
        self.pending += new
        if self.stop:
            self.state, body, hit = self.stops.read(self.state, new)
            self.body = self.body if body is None else body
        return None if hit is None else (hit[0] + at, hit[1] + at)

    def _search_window(self) -> tuple[int, int] | None:
        """The first stop string in the last `longest` released characters and `pending`, as
        offsets into `pending`: text read unchecked may hold one."""
        hit = self.stops.read(0, self.tail + self.pending)[2]
        return None if hit is None else (hit[0] - len(self.tail), hit[1] - len(self.tail))

    def _hold(self) -> int:
        """Characters at the end that could still change: a partial character, or a prefix of
        a stop string."""
        return self.run + self.stops.held[self.body]

    def _held(self, text: str) -> int:
        """`_hold` for `text` read whole."""
        run = len(text) - len(text.rstrip(REPLACEMENT))
        body = self.stops.read(0, text[: len(text) - run])[0]
        return run + self.stops.held[body]
