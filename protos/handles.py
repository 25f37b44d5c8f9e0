"""A sequence's handle and what the operations return: the types the model contract
(`protos.model`) and the step stream (`protos.steps`) both speak, apart from either."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SequenceHandle:
    """The caller's handle on a sequence the service owns; every reply updates `seq_len`."""

    seq_id: int  # never reused by the service
    slot: int  # state slot: attention KV rows, GDN state, conv window, drafter KV
    seq_len: int = 0  # tokens in the target's cache, mirrored from the last reply


@dataclass(frozen=True)
class RowDraws:
    p_next: float  # target probability of the next row's token (0 for the last row)
    resample: int  # draw from the residual (the target itself when no draft distribution)
    sample: int  # draw from the target


@dataclass(frozen=True)
class ScoreAsk:
    """A prompt's rows to score in a prefill: `top` alternatives per row (0 to `MAX_TOP`);
    `next_token`, the token after this chunk when the chunk does not end the prompt, which
    its last row is scored against."""

    top: int = 0
    next_token: int | None = None


MAX_TOP = 20  # alternatives a row's score may list, as vLLM and OpenAI bound them


@dataclass(frozen=True)
class Scores:
    """A prompt chunk's rows scored, raw (the model's log-softmax: no penalty, no mask):
    `logprobs[j]` is row j's log-probability of the token after it (the chunk's next one, or
    `next_token`), one per row but the last when no `next_token` was given; `top_ids[j]` and
    `top_logprobs[j]` are row j's most probable tokens, every row, the last included."""

    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
    ranks: list[int] = field(default_factory=list)  # each of `logprobs`' tokens' (1: the first)


@dataclass(frozen=True)
class Prefilled:
    """What a prefill returns: per prompt, its last row's argmax and that token's
    log-probability, and the scores of the prompts asked for them (None for the others)."""

    argmax: list[int]
    logprobs: list[float]
    scores: list[Scores | None] = field(default_factory=list)


@dataclass(frozen=True)
class Verified:
    """What a batched verify returns, per row in row order: its argmax, that token's
    log-probability, and for a sampling sequence's rows what rejection sampling needs (None on
    a greedy sequence's rows)."""

    argmax: list[int]
    logprobs: list[float]
    draws: list[RowDraws | None]


@dataclass(frozen=True)
class Proposal:
    drafts: list[list[int]]  # [sequences][num_drafts]
    confidences: list[list[float]]  # softmax probability of each draft, same layout


@dataclass(frozen=True)
class StepResult:
    """One greedy speculative step (`decode_step`): the verify's rows and what the verdict
    made of them."""

    argmax: list[int]  # every row's argmax, in row order
    logprobs: list[float]  # each argmax's log-probability
    accepted: list[int]  # per sequence: drafts that stood
    proposers: list[int]  # indexes of the sequences that got new drafts
    proposal: Proposal  # their drafts, in `proposers` order
