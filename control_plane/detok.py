"""Incremental detokenization with stop strings: text is released only once it can no longer
become part of a stop string, and never with a half-decoded character at its end."""

from __future__ import annotations

from typing import Protocol


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


REPLACEMENT = "\ufffd"


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0
        self.stopped = False

    def push(self, ids: list[int], check_stop: bool = True) -> bool:
        """Add tokens; True when a stop string now appears (the text is cut before it)."""
        self.ids.extend(ids)
        self.text = self.tokenizer.decode(self.ids)
        if not check_stop or not self.stop:
            return False
        longest = max(len(s) for s in self.stop)
        start = max(0, self.sent - longest)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
        return self.stopped

    def delta(self, final: bool = False) -> str:
        """The text not yet released that is safe to release now (all of it when final)."""
        end = len(self.text)
        if not final and not self.stopped:
            end -= self._held(self.text)
        out = self.text[self.sent : max(end, self.sent)]
        self.sent += len(out)
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
