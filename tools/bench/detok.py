"""What streaming detokenization costs per token as an output grows: the `Detokenizer` (each
token decoded once by the tokenizer's stream) beside decoding the whole output again at every
token, the method it replaced. `python -m tools.bench.detok [--model DIR]`
prints microseconds per token at each output length; the first column stays flat, the second
grows with the length. Then the cost per token with one stop string and with the most a request
may send (`protos.checks.LIMITS`), for the automaton beside the search of every stop string at
every step (`ScanDetokenizer`, the method it replaced), and the automaton's build time."""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from control_plane.text.detok import REPLACEMENT, Detokenizer, StopStrings, Tokenizer, text_stream
from control_plane.text.tokenizer import load_tokenizer
from protos.checks import MAX_STOP_CHARS, MAX_STOP_STRINGS
from protos.defaults import DEFAULT_MODEL_DIR

LENGTHS = (500, 1000, 2000, 4000)
STOP = ("<|stop|>",)  # never in the text: the hold-back search runs at every token
STOP_COUNTS = (1, MAX_STOP_STRINGS)
STOP_TOKENS = 2000  # the output length the stop strings are timed over


class ScanDetokenizer:
    """The stop strings' method the automaton replaced: each one searched for in the window
    (the last `longest` released characters and the pending text) at every step, and each one's
    prefixes tried against the window's end at every release. Its observable behaviour is the
    `Detokenizer`'s; the tests hold them to it."""

    def __init__(
        self, tokenizer: Tokenizer, stop: tuple[str, ...] = (), include_stop: bool = False
    ) -> None:
        self.stream = text_stream(tokenizer)
        self.stop = tuple(s for s in stop if s)
        self.include_stop = include_stop
        self.longest = max((len(s) for s in self.stop), default=0)
        self.parts: list[str] = []
        self.tail = ""  # the last `longest` released characters
        self.pending = ""
        self.stopped = False

    @property
    def text(self) -> str:
        return "".join(self.parts) + self.pending

    def push(self, ids: list[int], check_stop: bool = True) -> bool:
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
        held = len(text) - len(text.rstrip(REPLACEMENT))
        body = text[: len(text) - held]
        for s in self.stop:
            for n in range(min(len(s) - 1, len(body)), 0, -1):
                if body.endswith(s[:n]):
                    held = max(held, len(text) - len(body) + n)
                    break
        return held


def output_ids(tokenizer: Tokenizer, n: int) -> list[int]:
    """n tokens of real text (this repository's detokenizer source, repeated)."""
    import control_plane.text.detok as source

    text = inspect.getsource(source)
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(text)
    return ids[:n]


def streamed(
    tokenizer: Tokenizer,
    ids: list[int],
    stop: tuple[str, ...] = STOP,
    kind: type[Detokenizer] | type[ScanDetokenizer] = Detokenizer,
) -> str:
    d = kind(tokenizer, stop)
    out = []
    for t in ids:
        d.push([t])
        out.append(d.delta())
    out.append(d.delta(final=True))
    return "".join(out)


def redecoded(tokenizer: Tokenizer, ids: list[int]) -> str:
    """The old method: the whole output decoded again at every token."""
    released = ""
    for i in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:i])
        released = text
    return released


def per_token_us(
    fn: Callable[[Tokenizer, list[int]], str], tok: Tokenizer, ids: list[int], repeats: int
) -> float:
    """The median over `repeats` runs, in microseconds per token."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(tok, ids)
        times.append(time.perf_counter() - start)
    return statistics.median(times) / len(ids) * 1e6


def measure(
    tokenizer: Tokenizer, lengths: tuple[int, ...] = LENGTHS, repeats: int = 3
) -> list[dict]:
    rows = []
    for n in lengths:
        ids = output_ids(tokenizer, n)
        if streamed(tokenizer, ids) != tokenizer.decode(ids):
            raise RuntimeError(f"the stream's text of {n} tokens is not the decoded text")
        rows.append(
            {
                "tokens": n,
                "streamed_us_per_token": per_token_us(streamed, tokenizer, ids, repeats),
                "redecoded_us_per_token": per_token_us(redecoded, tokenizer, ids, repeats),
            }
        )
    return rows


def unfound_stops(text: str, count: int) -> tuple[str, ...]:
    """`count` stop strings of `MAX_STOP_CHARS // count` characters (at most 32), each a piece
    of `text` with its last character changed: most steps end inside one of them, so text is
    held back, but none is ever found."""
    size = min(32, MAX_STOP_CHARS // count)
    step = max(1, (len(text) - size) // count)
    return tuple(text[i * step : i * step + size - 1] + "\x00" for i in range(count))


def measure_stops(
    tokenizer: Tokenizer,
    counts: tuple[int, ...] = STOP_COUNTS,
    tokens: int = STOP_TOKENS,
    repeats: int = 3,
) -> list[dict]:
    """Microseconds per token with `count` stop strings, for the automaton and the scan; the
    automaton's build in milliseconds (median of `repeats`)."""
    ids = output_ids(tokenizer, tokens)
    text = tokenizer.decode(ids)
    rows = []
    for count in counts:
        stop = unfound_stops(text, count)
        for kind in (Detokenizer, ScanDetokenizer):
            if streamed(tokenizer, ids, stop, kind) != text:
                raise RuntimeError(f"{kind.__name__}'s text with {count} stop strings differs")

        builds = []
        for _ in range(repeats):
            start = time.perf_counter()
            StopStrings(stop)
            builds.append(time.perf_counter() - start)
        rows.append(
            {
                "stops": count,
                "characters": sum(map(len, stop)),
                "automaton_us_per_token": per_token_us(
                    partial(streamed, stop=stop, kind=Detokenizer), tokenizer, ids, repeats
                ),
                "scan_us_per_token": per_token_us(
                    partial(streamed, stop=stop, kind=ScanDetokenizer), tokenizer, ids, repeats
                ),
                "build_ms": statistics.median(builds) * 1e3,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer(args.model)
    rows = measure(tokenizer, repeats=args.repeats)
    stop_rows = measure_stops(tokenizer, repeats=args.repeats)
    if args.json:
        print(json.dumps({"lengths": rows, "stops": stop_rows}, indent=2))
        return 0
    print(f"{'tokens':>7} {'streamed us/token':>18} {'re-decoded us/token':>20}")
    for r in rows:
        print(
            f"{r['tokens']:>7} {r['streamed_us_per_token']:>18.2f} "
            f"{r['redecoded_us_per_token']:>20.2f}"
        )
    print(f"\n{STOP_TOKENS} tokens with stop strings:")
    head = ("stops", 6), ("chars", 6), ("automaton us/token", 19), ("scan us/token", 14)
    print(" ".join(f"{name:>{width}}" for name, width in head), f"{'build ms':>9}")
    for r in stop_rows:
        print(
            f"{r['stops']:>6} {r['characters']:>6} {r['automaton_us_per_token']:>19.2f} "
            f"{r['scan_us_per_token']:>14.2f} {r['build_ms']:>9.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
