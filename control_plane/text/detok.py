"""Incremental detokenization with stop strings: text is released only once it can no longer
become part of a stop string, and never with a half-decoded character at its end.

Each token is decoded once, by the tokenizer's `TextStream` (or a short window of ids for a
tokenizer without one), so a step costs the same however long the output already is."""

from __future__ import annotations

from typing import Protocol

REPLACEMENT = "\ufffd"


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


class Detokenizer:
    """Released text lives in `parts`; `pending` is decoded text not yet released. Stop
    strings are searched in `pending` and the last `longest` released characters."""

    def __init__(
        self, tokenizer: Tokenizer, stop: tuple[str, ...] = (), include_stop: bool = False
    ) -> None:
        self.stream = text_stream(tokenizer)
        self.stop = tuple(s for s in stop if s)
        self.include_stop = include_stop  # the text ends after the stop string, not before
        self.longest = max((len(s) for s in self.stop), default=0)
        self.ids: list[int] = []
        self.parts: list[str] = []
        self.tail = ""  # the last `longest` released characters
        self.pending = ""
        self.stopped = False

    @property
    def text(self) -> str:
        """All the text so far, cut before a stop string."""
        return "".join(self.parts) + self.pending

    def push(self, ids: list[int], check_stop: bool = True) -> bool:
        """Add tokens; True when a stop string now appears (the text is cut before it)."""
        self.ids.extend(ids)
        if not self.stopped:
            self.pending += "".join(self.stream.step(t) for t in ids)
        if not check_stop or not self.stop or self.stopped:
            return self.stopped
        window = self.tail + self.pending
        hits = [(i, i + len(s)) for s in self.stop if (i := window.find(s)) >= 0]
        if hits:
            start, end = min(hits)
            cut = end if self.include_stop else start
            self.pending = window[len(self.tail) : max(cut, len(self.tail))]
            self.stopped = True
        return self.stopped

    def delta(self, final: bool = False) -> str:
        """The text not yet released that is safe to release now (all of it when final)."""
        if final and not self.stopped:
            self.pending += self.stream.flush()
        out = self.pending
        if not final and not self.stopped:
            window = self.tail + out
            out = out[: max(0, len(window) - self._held(window) - len(self.tail))]
        self.pending = self.pending[len(out) :]
        if out:
            self.parts.append(out)
            self.tail = (self.tail + out)[-self.longest :] if self.longest else ""
        return out

    def _held(self, text: str) -> int:
        """Characters at the end that could still change: a partial character, or a prefix of
        a stop string."""
        held = len(text) - len(text.rstrip(REPLACEMENT))
        body = text[: len(text) - held]
        for s in self.stop:
            for n in range(min(len(s) - 1, len(body)), 0, -1):
                if body.endswith(s[:n]):
                    held = max(held, len(text) - len(body) + n)
                    break
        return held
