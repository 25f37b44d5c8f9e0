"""A sequence's handle and what the operations return: the types the model contract
(`protos.model`) and the step stream (`protos.steps`) both speak, apart from either."""

from __future__ import annotations

from dataclasses import dataclass


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
class Prefilled:
    """What a prefill returns: per prompt, its last row's argmax and that token's
    log-probability."""

    argmax: list[int]
    logprobs: list[float]


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
