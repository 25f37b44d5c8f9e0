"""What streaming detokenization costs per token as an output grows: the `Detokenizer` (each
token decoded once by the tokenizer's stream) beside decoding the whole output again at every
token, the method it replaced. `python -m tools.bench.detok [--model DIR]`
prints microseconds per token at each output length; the first column stays flat, the second
grows with the length."""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from control_plane.text.detok import Detokenizer, Tokenizer
from control_plane.text.tokenizer import load_tokenizer
from protos.defaults import DEFAULT_MODEL_DIR

LENGTHS = (500, 1000, 2000, 4000)
STOP = ("<|stop|>",)  # never in the text: the hold-back search runs at every token


def output_ids(tokenizer: Tokenizer, n: int) -> list[int]:
    """n tokens of real text (this repository's detokenizer source, repeated)."""
    import control_plane.text.detok as source

    text = inspect.getsource(source)
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(text)
    return ids[:n]


def streamed(tokenizer: Tokenizer, ids: list[int]) -> str:
    d = Detokenizer(tokenizer, STOP)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    rows = measure(load_tokenizer(args.model), repeats=args.repeats)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'tokens':>7} {'streamed us/token':>18} {'re-decoded us/token':>20}")
    for r in rows:
        print(
            f"{r['tokens']:>7} {r['streamed_us_per_token']:>18.2f} "
            f"{r['redecoded_us_per_token']:>20.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
