"""The reasoning block of a chat's output as a phase of its grammar. Where the template opens a
block (`<think>`, as Qwen3.6's does with thinking on), or lets the model open one at the output's
start, a forced output (the calls of a required or named tool, a response format) holds only
after the block closes, as vLLM applies a grammar after its reasoning parser's end; a budget of
reasoning tokens (vLLM's `thinking_token_budget`) forces the close when it is spent.

`AfterReasoning` is that phase in front of an inner `Grammar` (or of none: a budget alone).
While the model reasons it constrains nothing: its masks are empty, and it keeps only the drafts
before one that would close the block or spend the budget, so every row it would constrain is
verified with its mask; meanwhile the scheduler batches and fuses its steps as an unconstrained
sequence's. The close is found in the text (`</think>` however the tokens spell it), where
`tools.ChatOutput` splits the reasoning from the content."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache

from control_plane.text.grammar import Grammar, GrammarCompiler
from control_plane.text.tools import THINK_CLOSE, THINK_OPEN

# Where a chat's output starts: inside a block its prompt opened, or where the model may open
# one (a template that knows reasoning, a prompt that neither opened nor closed a block).
OPENED, MAY_OPEN = "opened", "may_open"
# The phases of `AfterReasoning`.
START, THINK, CLOSING, AFTER = "start", "think", "closing", "after"
_CLOSE = THINK_CLOSE.encode()
# Of a request's max_tokens, at most this many are kept for a forced output when the request
# sets no reasoning budget (half of max_tokens, when that is less).
OUTPUT_RESERVE = 2048


@dataclass(frozen=True)
class Marks:
    """How one vocabulary writes a reasoning block's ends."""

    close: tuple[int, ...]  # `</think>` as the tokenizer writes it: forced when a budget is spent
    open: int | None  # `<think>`, when one token writes it (else the model opens no block)
    bytes_of: Callable[[list[int]], bytes]  # tokens' text, as bytes
    vocab_size: int

    @classmethod
    def of(cls, compiler: GrammarCompiler) -> Marks:
        opening = compiler.source.encode(THINK_OPEN)
        return cls(
            tuple(compiler.source.encode(THINK_CLOSE)),
            opening[0] if len(opening) == 1 else None,
            compiler.tokenizer.decode_bytes,
            compiler.vocab_size,
        )

    def only(self, token: int) -> bytes:
        """A mask allowing `token` alone."""
        bits = bytearray(4 * -(-self.vocab_size // 32))
        bits[token // 8] |= 1 << (token % 8)
        return bytes(bits)


@lru_cache(maxsize=8)
def marks_of(compiler: GrammarCompiler) -> Marks:
    """The marks of a compiler's vocabulary, found once."""
    return Marks.of(compiler)


@dataclass
class _State:
    phase: str
    spent: int = 0  # reasoning tokens so far
    tail: bytes = b""  # the reasoning's last bytes, fewer than the close's
    forced: int = 0  # of the close's tokens, forced so far


class _Refused(Exception):
    pass


def default_budget(max_new: int) -> int:
    """A forced output's reasoning budget when its request sets none: all of `max_new` but what
    is kept for the output (half, at most `OUTPUT_RESERVE`)."""
    return max_new - min(max_new // 2, OUTPUT_RESERVE)


def after_reasoning(
    inner: Grammar | None,
    marks: Callable[[], Marks],
    start: str,
    budget: int | None,
    max_new: int,
) -> Grammar | None:
    """The grammar of a chat's output that starts at `start` (OPENED, MAY_OPEN, or "": no
    reasoning): `inner` after the reasoning, which takes at most `budget` tokens (None: a
    forced output's `default_budget`, else no bound)."""
    if not start or (inner is None and budget is None):
        return inner
    found = marks()
    if start == MAY_OPEN and found.open is None:
        return inner  # no block can open: the output is the inner grammar's from its start
    if budget is None:
        budget = default_budget(max_new)
    return AfterReasoning(inner, found, start, budget)


class AfterReasoning:
    """A `Grammar`: the output's reasoning free (closed by the model, or forced closed after
    `budget` tokens), then `inner` (None: anything)."""

    def __init__(self, inner: Grammar | None, marks: Marks, start: str, budget: int | None):
        self.inner, self.marks, self.budget = inner, marks, budget
        phase = THINK if start == OPENED else START if marks.open is not None else AFTER
        self.state = _State(phase)
        self._spend(self.state)

    def advance(self, tokens: list[int]) -> None:
        try:
            used = self._walk(self.state, tokens)
        except _Refused as e:
            raise ValueError(f"the grammar refused committed tokens: {e}") from None
        if used < len(tokens) and self.inner is not None:
            self.inner.advance(tokens[used:])

    def mask(self) -> bytes:
        return self.mask_after([])

    def mask_after(self, tokens: list[int]) -> bytes:
        s = replace(self.state)
        used = self._walk(s, tokens)
        if s.phase == CLOSING:
            return self.marks.only(self.marks.close[s.forced])
        if self.inner is None or s.phase == THINK:
            return b""
        if s.phase == AFTER:
            return self.inner.mask_after(tokens[used:])
        assert self.marks.open is not None  # START: the inner grammar's first token, or `<think>`
        bits = bytearray(self.inner.mask())
        bits[self.marks.open // 8] |= 1 << (self.marks.open % 8)
        return bytes(bits)

    def valid_prefix(self, tokens: list[int]) -> int:
        s, i = replace(self.state), 0
        while i < len(tokens):
            if s.phase == AFTER:
                rest = tokens[i:]
                return i + (len(rest) if self.inner is None else self.inner.valid_prefix(rest))
            was = s.phase
            try:
                if not self._step(s, tokens[i]):
                    continue  # the model opened no block: the token is the inner grammar's
            except _Refused:
                return i
            if was == THINK and s.phase != THINK:
                return i  # it closes the block or spends the budget: the rows after it are masked
            i += 1
        return len(tokens)

    def is_done(self) -> bool:
        return self.state.phase == AFTER and self.inner is not None and self.inner.is_done()

    def constrains(self) -> bool:
        phase = self.state.phase
        return phase == CLOSING or (self.inner is not None and phase in (START, AFTER))

    def remaining(self) -> Grammar | None:
        return self.inner if self.state.phase == AFTER else self

    def _walk(self, s: _State, tokens: list[int]) -> int:
        """`s` after `tokens`; -> how many of them the reasoning took (the rest: the inner
        grammar's)."""
        for i, t in enumerate(tokens):
            if not self._step(s, t):
                return i
        return len(tokens)

    def _step(self, s: _State, t: int) -> bool:
        """`s` after `t`; False when `t` is past the reasoning (the inner grammar's)."""
        if s.phase == START:
            if t != self.marks.open:
                s.phase = AFTER
                return False
            s.phase = THINK
        elif s.phase == THINK:
            s.spent += 1
            text = s.tail + self.marks.bytes_of([t])
            if _CLOSE in text:
                s.phase = AFTER
                return True
            s.tail = text[1 - len(_CLOSE) :]
        elif s.phase == CLOSING:
            want = self.marks.close[s.forced]
            if t != want:
                raise _Refused(f"token {t} where the reasoning's close forces {want}")
            s.forced += 1
            if s.forced == len(self.marks.close):
                s.phase = AFTER
            return True
        else:
            return False
        self._spend(s)
        return True

    def _spend(self, s: _State) -> None:
        """The close forced once the budget is spent."""
        if s.phase == THINK and self.budget is not None and s.spent >= self.budget:
            s.phase, s.forced = CLOSING, 0
