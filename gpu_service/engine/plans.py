"""Step plans (`StepPlan`) run on the engine: a continuing sequence's rows come from its own
last verdict, kept on its state by `decode_step`; a sequence the plan cannot run is refused
alone and the rest of the plan runs; a malformed plan is refused for every sequence it names.
`EngineSteps` is the in-process step stream: plans queue to a worker thread that runs them
back to back, as the GPU service's stream does; both time their waits with `PlanClock`."""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

from protos import checks
from protos.model import (
    FailedPrecondition,
    InvalidArgument,
    ModelError,
    Proposal,
    SequenceHandle,
    StepResult,
)
from protos.steps import MAX_PLAN_REPEAT, PlanResult, StepPlan

Refusal = tuple[int, str, str]


def check_plan(plan: StepPlan) -> None:
    """What refuses a plan whole: parallel lists of different lengths (`drafters` may be
    empty), a sequence named twice,
    tokens that do not fill the rows of the sequences that give theirs, more steps than
    MAX_PLAN_REPEAT, more later steps' trace contexts than later steps."""
    checks.same_length(
        "a step plan",
        seqs=plan.seqs,
        continues=plan.continues,
        ks=plan.ks,
        want_drafts=plan.want_drafts,
    )
    if plan.drafters:
        checks.same_length("a step plan", seqs=plan.seqs, drafters=plan.drafters)
    checks.distinct("a step plan", [h.seq_id for h in plan.seqs])
    given = sum(k for k, c in zip(plan.ks, plan.continues, strict=True) if not c)
    if given != len(plan.tokens):
        raise InvalidArgument(f"a step plan gives {len(plan.tokens)} tokens for {given} rows")
    if not 1 <= plan.repeat <= MAX_PLAN_REPEAT:
        raise InvalidArgument(
            f"a step plan repeats {plan.repeat} times; it runs 1 to {MAX_PLAN_REPEAT} steps"
        )
    if len(plan.then_trace) > plan.repeat - 1:
        raise InvalidArgument(
            f"a step plan gives {len(plan.then_trace)} trace contexts for its "
            f"{plan.repeat - 1} later steps"
        )


def refuse_all(plan: StepPlan, error: ModelError) -> PlanResult:
    """The result of a plan refused whole: every sequence it names, with the one sentence."""
    refused = [(i, error.code, str(error)) for i in range(len(plan.seqs))]
    return PlanResult(StepResult([], [], [], [], Proposal([], [])), [], [], [], refused)


def plan_rows(
    plan: StepPlan, continuation: Callable[[SequenceHandle], list[int] | None]
) -> tuple[list[int], list[list[int]], list[Refusal]]:
    """-> (the indexes that can run, their rows, the refused): `continuation` gives what a
    sequence's last step left to verify (None: nothing; raises `ModelError` for a sequence
    the service does not know)."""
    check_plan(plan)
    ran, rows, refused, at = [], [], [], 0
    for i, (handle, cont, k) in enumerate(zip(plan.seqs, plan.continues, plan.ks, strict=True)):
        own = plan.tokens[at : at + k] if not cont else None
        at += 0 if cont else k
        try:
            if cont:
                own = continuation(handle)
                if own is None:
                    raise FailedPrecondition(
                        f"sequence {handle.seq_id} has no step of its own to continue from (its "
                        "last call was not a decode step, or it was refused)"
                    )
                own = own[:k] if k else own
        except ModelError as e:
            refused.append((i, e.code, str(e)))
            continue
        assert own is not None
        ran.append(i)
        rows.append(own)
    return ran, rows, refused


def run_plan(
    plan: StepPlan,
    continuation: Callable[[SequenceHandle], list[int] | None],
    decode_step: Callable[..., StepResult],
) -> PlanResult:
    """The plan on `decode_step`. A refusal of the whole call is narrowed to the sequence it
    concerns: each sequence runs alone (its rows are batch invariant, so the others' tokens
    are those of the batch)."""
    try:
        ran, rows, refused = plan_rows(plan, continuation)
    except ModelError as e:
        return refuse_all(plan, e)
    if not ran:
        return PlanResult(StepResult([], [], [], [], Proposal([], [])), [], [], [], refused)
    seqs = [plan.seqs[i] for i in ran]
    want = [plan.want_drafts[i] for i in ran]
    flat, ks = [t for r in rows for t in r], [len(r) for r in rows]
    try:
        step = decode_step(flat, ks, seqs, want, plan.num_drafts, _drafters(plan, ran))
        return PlanResult(step, ran, flat, ks, refused)
    except ModelError as e:
        if len(ran) == 1:
            return PlanResult(
                StepResult([], [], [], [], Proposal([], [])),
                [],
                [],
                [],
                sorted([*refused, (ran[0], e.code, str(e))]),
            )
    return _one_by_one(plan, ran, rows, refused, decode_step)


def _one_by_one(
    plan: StepPlan,
    ran: list[int],
    rows: list[list[int]],
    refused: list[Refusal],
    decode_step: Callable[..., StepResult],
) -> PlanResult:
    argmax: list[int] = []
    logprobs: list[float] = []
    accepted: list[int] = []
    proposers: list[int] = []
    drafts: list[list[int]] = []
    confs: list[list[float]] = []
    kept: list[int] = []
    flat: list[int] = []
    ks: list[int] = []
    for i, r in zip(ran, rows, strict=True):
        try:
            s = decode_step(
                r,
                [len(r)],
                [plan.seqs[i]],
                [plan.want_drafts[i]],
                plan.num_drafts,
                _drafters(plan, [i]),
            )
        except ModelError as e:
            refused.append((i, e.code, str(e)))
            continue
        if s.proposers:
            proposers.append(len(kept))
            drafts += s.proposal.drafts
            confs += s.proposal.confidences
        kept.append(i)
        argmax += s.argmax
        logprobs += s.logprobs
        accepted += s.accepted
        flat += r
        ks.append(len(r))
    step = StepResult(argmax, logprobs, accepted, proposers, Proposal(drafts, confs))
    return PlanResult(step, kept, flat, ks, sorted(refused))


def _drafters(plan: StepPlan, ran: list[int]) -> list[str]:
    """The plan's drafter names of the sequences at `ran` (none where it names none)."""
    return [plan.drafters[i] for i in ran] if plan.drafters else []


def run_without(
    plan: StepPlan, refused: Sequence[Refusal], run: Callable[[StepPlan], PlanResult]
) -> PlanResult:
    """`run` of the plan less the sequences its caller refused already (the servicer refuses
    other sessions' sequences, which the engine cannot tell from its own), their refusals
    merged into the result."""
    if not refused:
        return run(plan)
    try:
        check_plan(plan)
    except ModelError as e:
        return refuse_all(plan, e)
    out = {i for i, _, _ in refused}
    keep = [i for i in range(len(plan.seqs)) if i not in out]
    tokens, at = [], 0
    for i, (cont, k) in enumerate(zip(plan.continues, plan.ks, strict=True)):
        if not cont:
            tokens += plan.tokens[at : at + k] if i not in out else []
            at += k
    r = run(
        replace(
            plan,
            seqs=[plan.seqs[i] for i in keep],
            continues=[plan.continues[i] for i in keep],
            tokens=tokens,
            ks=[plan.ks[i] for i in keep],
            want_drafts=[plan.want_drafts[i] for i in keep],
            drafters=_drafters(plan, keep),
        )
    )
    lifted = [(keep[j], code, sentence) for j, code, sentence in r.refused]
    return replace(r, ran=[keep[j] for j in r.ran], refused=sorted([*refused, *lifted]))


def plan_steps(
    plan: StepPlan,
    refused: Sequence[Refusal],
    run: Callable[[StepPlan], PlanResult],
    clock: PlanClock,
    arrived: float,
) -> Iterator[PlanResult]:
    """Each step's result of `plan` as the step ends: the plan as sent, then its `repeat - 1`
    more steps, in which every sequence continues from its own verdict. A plan refused whole
    is refused at each step it names (once when it names too many), and changes nothing."""
    error: ModelError | None = None
    try:
        check_plan(plan)
    except ModelError as e:
        error = e
    if error is not None:
        whole = refuse_all(plan, error)
        for _ in range(plan.repeat if 1 <= plan.repeat <= MAX_PLAN_REPEAT else 1):
            yield clock.run(arrived, lambda: whole)
        return
    yield clock.run(arrived, lambda: run_without(plan, refused, run))
    again = replace(plan, continues=[True] * len(plan.seqs), tokens=[], repeat=1, then_trace=[])
    for j in range(plan.repeat - 1):
        trace = plan.then_trace[j] if j < len(plan.then_trace) else plan.trace
        step = replace(again, trace=trace)
        yield clock.run(0.0, functools.partial(run_without, step, refused, run))  # already there


class PlanClock:
    """How long a stream kept its runner waiting for each plan: from the end of the previous
    plan to this plan's arrival; 0 for the first, and for a plan that was there already, so
    that plans sent ahead read 0 however the runner hands over between them. One thread (the
    runner's) calls `run`."""

    def __init__(self) -> None:
        self._ended: float | None = None

    def run(self, arrived: float, plan: Callable[[], PlanResult]) -> PlanResult:
        """`plan()`'s result with its wait; `arrived`: `time.perf_counter()` when the plan
        reached the stream."""
        waited = 0.0 if self._ended is None else max(0.0, arrived - self._ended)
        try:
            return replace(plan(), waited_s=waited)
        finally:
            self._ended = time.perf_counter()


class EngineSteps:
    """An in-process step stream over an engine's `run_plan`: one worker thread runs the
    plans in order; results (or the exception a plan raised) come back in order."""

    def __init__(self, run: Callable[[StepPlan], PlanResult]) -> None:
        self._run = run
        self._plans: queue.Queue[tuple[StepPlan, float] | None] = queue.Queue()
        self._results: queue.Queue[PlanResult | BaseException] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="engine-steps", daemon=True)
        self._thread.start()

    def send(self, plan: StepPlan) -> None:
        self._plans.put((plan, time.perf_counter()))

    def recv(self) -> PlanResult:
        result = self._results.get()
        if isinstance(result, BaseException):
            raise result
        return result

    def close(self) -> None:
        self._plans.put(None)
        self._thread.join(timeout=30)

    def _work(self) -> None:
        clock = PlanClock()
        while (item := self._plans.get()) is not None:
            plan, arrived = item
            try:
                for result in plan_steps(plan, [], self._run, clock, arrived):
                    self._results.put(result)
            except Exception as e:  # handed to the reader, who decides what it ends
                self._results.put(e)
