"""A sequence's handle and what a greedy step returns: the types the `Model` protocol and the
step stream (`protos.steps`) both speak, apart from either."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SequenceHandle:
    """The caller's handle on a sequence the service owns; every reply updates `seq_len`."""

    seq_id: int  # never reused by the service
    slot: int  # state slot: attention KV rows, GDN state, conv window, drafter KV
    seq_len: int = 0  # tokens in the target's cache, mirrored from the last reply


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
