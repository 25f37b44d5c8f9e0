"""Input checks shared by the engine's operations. Each raises a `ModelError` with a sentence,
before any state is touched. Beside them, the parser of the `A:B,...` settings that both
processes read (it raises `ValueError`: a bad setting is the operator's, not a client's).

The ranges of a request's numbers live here once (`FLOATS`, `INTS`): the `Door`, the OpenAI
front, the GPU service and `met generate`'s flags all ask `number_problem` / `int_problem`. So
do the sizes of what a request adds to every step (`LIMITS`, `limit_problem`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from protos.model import FailedPrecondition, InvalidArgument, Penalties


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


@dataclass(frozen=True)
class Bounds:
    """The values a number may take: `low ..= high`, or `also` (a value with a meaning of its
    own, like a temperature of 0: greedy). NaN fails every comparison, so each test is written
    as what must hold, and an infinity is outside all bounds."""

    low: float
    high: float
    text: str  # what the sentence says the value must be
    also: float | None = None

    def holds(self, value: float) -> bool:
        return self.low <= value <= self.high or value == self.also


# Why these ends. A logit a model produces is far below fp32's (and bf16's) largest finite
# value, 3.4e38. Every adjustment keeps such a logit finite with room to spare: the repetition
# penalty divides a positive logit by r and multiplies a negative one, so r in 0.01 ..= 100
# moves any logit under 3.4e36 at most a factor of 100 (a penalty just above 0, as vLLM's
# `> 0` allows, sends logit / r to infinity and every logprob to NaN); presence, frequency and
# bias add at most a context's count of 2s or one 100. The temperature divides logits in fp64
# (gpu_service/engine/sampling.py), and vLLM clamps it to 0.01 for the same reason the penalty is
# bounded. Every end is an fp32 number, so the wire's float holds each one, and the OpenAI
# front checks a JSON double before it is rounded to that float (1e39 is refused, not inf).
PENALTY_BOUND = 2.0  # vLLM's: presence and frequency penalties
BIAS_BOUND = 100.0  # OpenAI's: a logit bias
FLOATS: dict[str, Bounds] = {
    "temperature": Bounds(0.01, 100.0, "0 (greedy) or from 0.01 to 100", also=0.0),
    "top_p": Bounds(0.0, 1.0, "above 0 and at most 1, or 0 for no cut"),
    "min_p": Bounds(0.0, 1.0, "from 0 (no cut) to 1"),
    "presence_penalty": Bounds(-PENALTY_BOUND, PENALTY_BOUND, "from -2 to 2"),
    "frequency_penalty": Bounds(-PENALTY_BOUND, PENALTY_BOUND, "from -2 to 2"),
    "repetition_penalty": Bounds(0.01, 100.0, "from 0.01 to 100 (1: none)"),
    "logit_bias": Bounds(-BIAS_BOUND, BIAS_BOUND, "from -100 to 100"),
    "uniform": Bounds(0.0, 1.0, "from 0 to 1"),  # a draw's uniform, sent by the control plane
}

UINT32, UINT64 = (1 << 32) - 1, (1 << 64) - 1
INT32 = (1 << 31) - 1
# Whole numbers of a `GenerateRequest`: what the wire type holds, and what no served model
# changes (the `Door` checks what depends on the model: the vocabulary, the context, drafts).
INTS: dict[str, Bounds] = {
    "max_new_tokens": Bounds(1, UINT32, f"from 1 to {UINT32}"),
    "min_new_tokens": Bounds(0, UINT32, f"from 0 to {UINT32}"),
    "seed": Bounds(0, UINT64, f"from 0 to {UINT64}"),
    "top_k": Bounds(-1, INT32, f"-1 or 0 (no limit), or a count to {INT32}"),
    "num_drafts": Bounds(1, UINT32, f"from 1 to {UINT32}"),
    "token_id": Bounds(0, UINT32, f"from 0 to {UINT32}"),
}


@dataclass(frozen=True)
class Limit:
    """The most of something a request may send: `field` names it in the sentence."""

    field: str
    most: int
    noun: str  # what is counted


# What one request adds to the work of every step it takes part in: each character decoded is
# read by its stop strings' automaton (whose size is their characters in all, built at
# admission), each stop token id is masked in its rows before `min_new_tokens`, and its logit
# bias and allowed ids are applied to each of its rows by the GPU service. Generous for an
# OpenAI client (4 stop strings, 300 biases) and for vLLM's, which sets no limit.
MAX_STOP_STRINGS = 128
MAX_STOP_CHARS = 4096  # characters of all a request's stop strings together
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024
MAX_ALLOWED_TOKEN_IDS = 4096
LIMITS: dict[str, Limit] = {
    "stop": Limit("stop", MAX_STOP_STRINGS, "strings"),
    "stop_chars": Limit("stop", MAX_STOP_CHARS, "characters in all"),
    "stop_token_ids": Limit("stop_token_ids", MAX_STOP_TOKEN_IDS, "token ids"),
    "logit_bias": Limit("logit_bias", MAX_LOGIT_BIAS, "entries"),
    "allowed_token_ids": Limit("allowed_token_ids", MAX_ALLOWED_TOKEN_IDS, "token ids"),
}


def limit_problem(name: str, count: int) -> str | None:
    """A sentence, opening with the request's field, when `count` is past `LIMITS[name]`;
    None when it is within."""
    limit = LIMITS[name]
    if count <= limit.most:
        return None
    return f"{limit.field} holds {count} {limit.noun}; this server takes at most {limit.most}"


def number_problem(name: str, value: float, shown: str | None = None) -> str | None:
    """A sentence when `value` is outside `FLOATS[name]`, naming it as `shown` (default
    `name`); None when it holds."""
    bounds = FLOATS[name]
    if bounds.holds(value):
        return None
    return f"{shown or name} is {value}; it must be {bounds.text}"


def int_problem(name: str, value: int, shown: str | None = None) -> str | None:
    """As `number_problem`, for the whole numbers of `INTS`."""
    bounds = INTS[name]
    if bounds.holds(value):
        return None
    return f"{shown or name} is {value}; it must be {bounds.text}"


def number(name: str, value: float, shown: str | None = None) -> None:
    """`InvalidArgument` with `number_problem`'s sentence."""
    if (problem := number_problem(name, value, shown)) is not None:
        raise InvalidArgument(problem)


def finite(values: Sequence[float]) -> bool:
    """Whether every value is a finite number."""
    return all(math.isfinite(v) for v in values)


def penalties_problem(p: Penalties, vocab_size: int) -> str | None:
    """A sentence naming what of `p` is out of range (as a request names it), or None; the
    ranges are `FLOATS`, the sizes `LIMITS`."""
    for name, count in (("logit_bias", len(p.bias_ids)), ("allowed_token_ids", len(p.allowed_ids))):
        if (problem := limit_problem(name, count)) is not None:
            return problem
    for name, value in (
        ("presence_penalty", p.presence),
        ("frequency_penalty", p.frequency),
        ("repetition_penalty", p.repetition),
    ):
        if (problem := number_problem(name, value)) is not None:
            return problem
    if len(p.bias_ids) != len(p.bias_values):
        return f"logit_bias has {len(p.bias_ids)} token ids but {len(p.bias_values)} values"
    if len(set(p.bias_ids)) != len(p.bias_ids):
        return "logit_bias names a token id more than once"
    bad = next((t for t in p.allowed_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        outside = f"outside the vocabulary (0 .. {vocab_size - 1})"
        return f"allowed_token_ids holds token id {bad}, {outside}"
    for t, b in zip(p.bias_ids, p.bias_values, strict=True):
        if not 0 <= t < vocab_size:
            return f"logit_bias names token id {t}, outside the vocabulary (0 .. {vocab_size - 1})"
        if problem := number_problem("logit_bias", b, f"logit_bias of token {t}"):
            return problem
    return None
