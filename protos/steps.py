"""The step stream (`Model.open_steps`): greedy steps sent ahead, the control plane sending
step N + 1 while the service runs step N.

A step plan may ask the service to continue a sequence from its own previous result (the
bonus token and the drafts it proposed), which the control plane has not read yet. The
service's state is never guessed: a sequence touched by any other call since has nothing to
continue from, and is refused alone. Tokens a sequence gains after it finished are the control
plane's to discard. A plan may also run several such steps back to back (`StepPlan.repeat`),
each continuing from the one before: one message each way then carries several steps, which is
what a service whose host is busy with every message (an eager forward on CPU, under one
interpreter lock) needs; the control plane makes such plans only for sequences it would
continue anyway. The control plane still decides the policy of every step; the service
applies the greedy verdict rule to a step whose inputs are its own previous results.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from protos.handles import SequenceHandle, StepResult

# The most steps one plan may run (`StepPlan.repeat`): a plan runs to its end before the
# next one starts, so this bounds how long one message can keep the engine from the rest.
MAX_PLAN_REPEAT = 16


@dataclass(frozen=True)
class StepPlan:
    """One step of a step stream (`Model.open_steps`): a greedy `decode_step` whose rows the
    service may fill in itself. A sequence that `continues` verifies its own last verdict:
    the bonus token of its last `decode_step` (or plan) and the drafts that step proposed for
    it, at most `ks[i]` rows of them (0: all); the others give their rows in `tokens`, `ks[i]`
    of them each. A continuing sequence whose last operation was anything else (another call,
    a refusal, a free) is refused alone: its state is never guessed. A malformed plan (lists
    of other lengths, a sequence named twice, tokens that do not fill the rows) refuses every
    sequence with INVALID_ARGUMENT and changes nothing.

    A plan may `repeat`: after its first step the service runs `repeat - 1` more, in each of
    which every sequence of the plan continues from its own verdict, `ks[i]` rows at most, as
    if the caller had sent that plan (one that did not run is refused again, alone). Each
    step still gives its own `PlanResult`, in order; over gRPC one message each way carries
    them all. The caller plans `repeat` steps on statistics up to `repeat` steps old, and
    discards what a sequence finished before the last of them produced, as for any plan
    sent ahead."""

    seqs: list[SequenceHandle]
    continues: list[bool]
    tokens: list[int]  # the rows of the sequences that do not continue, in order
    ks: list[int]  # given rows, or the most rows a continuing sequence takes (0: all)
    want_drafts: list[bool]
    num_drafts: int
    trace: dict[str, str] = field(default_factory=dict)  # W3C trace context of the plan's span
    repeat: int = 1  # steps the plan runs
    # W3C trace contexts of the later steps' spans, in order; a step without one runs under
    # `trace`
    then_trace: list[dict[str, str]] = field(default_factory=list)
    # Per sequence (or empty: each its own), the drafter that proposes for it in every step
    # of the plan (`decode_step`'s `drafters`)
    drafters: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class PlanResult:
    """What one plan did, in plan order: `step` covers the sequences it ran (`ran`, indexes
    into the plan), whose rows `rows`/`ks` (the continuing ones filled in); `refused` the
    others, each with its status code and sentence. `waited_s`: how long the service sat idle
    between the previous plan of the stream and this one (0 for the first)."""

    step: StepResult
    ran: list[int]
    rows: list[int]
    ks: list[int]
    refused: list[tuple[int, str, str]]  # (index, status code name, sentence)
    waited_s: float = 0.0


class StepStream(Protocol):
    """Plans one way, results the other, in order, one result per step (a plan that repeats
    gives one per step it ran); the service runs plans back to back, so the caller sends plan
    N + 1 before it reads result N and the service never waits."""

    def send(self, plan: StepPlan) -> None: ...

    def recv(self) -> PlanResult:
        """The next plan's result, refusals inside it; raises what a transport failure
        raises (every plan in flight is then lost). A stream refused whole (a plan that does
        not parse: INVALID_ARGUMENT; its session gone) gives the results of every plan sent
        before the refusal, which ran, and then raises it: every stream ends with a status."""
        ...

    def close(self) -> None: ...
