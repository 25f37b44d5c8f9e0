"""Input checks shared by the engine's operations. Each raises a `ModelError` with a sentence,
before any state is touched. Beside them, the parser of the `A:B,...` settings that both
processes read (it raises `ValueError`: a bad setting is the operator's, not a client's)."""

from __future__ import annotations

from collections.abc import Sequence

from protos.model import FailedPrecondition, InvalidArgument


def same_length(what: str, **lists: Sequence) -> None:
    sizes = {name: len(v) for name, v in lists.items()}
    if len(set(sizes.values())) > 1:
        parts = ", ".join(f"{n} has {s}" for n, s in sizes.items())
        raise InvalidArgument(f"{what}: the lists differ in length ({parts})")


def not_empty(what: str, items: Sequence) -> None:
    if not items:
        raise InvalidArgument(f"{what} names no sequence")


def distinct(what: str, ids: Sequence[int], noun: str = "a sequence") -> None:
    if len(set(ids)) != len(ids):
        raise InvalidArgument(f"{what} names {noun} more than once")


def tokens_in_vocab(tokens: Sequence[int], vocab: int) -> None:
    for i, t in enumerate(tokens):
        if not 0 <= t < vocab:
            raise InvalidArgument(
                f"token id {t} at index {i} is outside the vocabulary (0 .. {vocab - 1})"
            )


def fits_context(seq_id: int, seq_len: int, extra: int, max_context: int) -> None:
    if seq_len + extra > max_context:
        raise InvalidArgument(
            f"sequence {seq_id} holds {seq_len} tokens; {extra} more exceed the context of "
            f"{max_context}"
        )


def within(name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise InvalidArgument(f"{name} is {value}; it must be in {low} ..= {high}")


def phase(seq_id: int, actual: str, expected: str, action: str) -> None:
    if actual != expected:
        reasons = {
            "idle": "no verify is pending",
            "verified": "its last verify is not folded yet",
            "folded": "its last verify is folded but not committed",
        }
        raise FailedPrecondition(f"cannot {action} sequence {seq_id}: {reasons[actual]}")


def parse_pairs(spec: str, what: str, first: str, second: str) -> list[tuple[int, int]]:
    """`"A:B,C:D,..."` -> [(A, B), (C, D), ...]: whole numbers, each first one at least 1 and
    each second one at least 0 (the K ladder's `ACTIVE:DRAFTS`, the verify tiers'
    `SLOTS:DRAFTS`). `what` names one pair and `first`, `second` its parts in the error
    sentence, a `ValueError` (a setting, not a request)."""
    pairs = []
    for part in spec.split(","):
        try:
            a, b = (int(x) for x in part.split(":"))
        except ValueError:
            a, b = 0, -1
        if a < 1 or b < 0:
            raise ValueError(
                f"bad {what} {part!r}: expected {first}:{second}, whole numbers with "
                f"{first} >= 1 and {second} >= 0"
            )
        pairs.append((a, b))
    return pairs
