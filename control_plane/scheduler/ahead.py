"""The pipelined step: greedy sequences of the methods that pipeline (`Method.pipelines`) run
one step ahead over the model's step stream (`ServingModel.open_steps`). Each iteration sends the
plan of step N + 1, which tells every sequence of step N to continue from the service's own
verdict, and only then reads step N's result; so the service runs step N + 1 while this process
streams step N's tokens, and never waits for it. Each plan names every sequence's drafter (its
method's, so the service drafts with the MTP head or a DFlash block per sequence) and proposes
one count for all: the least of its arms' widths, within every drafter's most (a DFlash
block's drafts).

What it costs in knowledge: a plan is made before the previous result is read, so the step's
width comes from statistics one step old, and a sequence that finishes in step N (EOS, a
stop, its length, a cancel) is already in step N + 1. Its part of that result is discarded,
never streamed, and its sequence is freed only once that result is back; a client receives
exactly the tokens of the unpipelined step (greedy verification is lossless whatever the
drafts). A sequence joins at the next plan with its rows given (after its prefill, or after
steps taken the synchronous way); one the service refuses in a plan ends alone.

What cannot run ahead does not: grammars and `min_new_tokens` (their masks need the latest
tokens), sampling, alternatives (`top_logprobs`: a step plan returns none), a method that does
not pipeline, the `--dflash` arm (every request's drafts planned as a block drafter's), the
confidence stop and `--no-batch-verify` go the synchronous way, in the same iteration, and
while any sequence does nothing runs ahead (a synchronous verify and its verdict may be two
calls, and nothing may run between them). D-Cut cuts a continuing sequence's drafts by the
confidences of the step before (the drafts it continues with are not back yet)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from opentelemetry import propagate
from opentelemetry.trace import Link, Span, set_span_in_context

from control_plane.scheduler.arm_dflash import block_width
from control_plane.scheduler.arms import step_mtp, step_width
from control_plane.scheduler.context import StepContext
from control_plane.scheduler.methods import BLOCKS
from control_plane.scheduler.metrics import REPLICA_ATTRIBUTE
from control_plane.scheduler.seq import ActiveSeq
from control_plane.scheduler.verdict import apply_step, drafter_names, offsets
from control_plane.scheduler.widths import dcut_depth
from protos.model import Proposal, SequenceHandle, ServingModel, StepResult
from protos.steps import PlanResult, StepPlan, StepStream
from protos.telemetry import tracer

TRACER = tracer("met.control_plane")


def runs_ahead(a: ActiveSeq, ctx: StepContext) -> bool:
    """Whether a sequence's next step may be planned before its last result is read."""
    o = ctx.opts
    return (
        o.pipeline
        and o.fused_step
        and o.batch_verify
        and not (o.dflash or o.prompt_lookup or o.draft_confidence_stop is not None)
        and a.method.pipelines
        and a.grammar is None
        and not a.samples
        and not a.req.top_logprobs
        and len(a.generated) >= a.req.min_new_tokens
    )


@dataclass
class SentStep:
    """One step sent and not yet read back (a plan that repeats sends several)."""

    seqs: list[ActiveSeq]
    step_nd: int
    span: Span
    sent: float  # `time.perf_counter()` when its plan went out
    plan_steps: int = 1  # steps of its plan
    ends_plan: bool = True  # the last step of its plan

    def holds(self, a: ActiveSeq) -> bool:
        return any(s is a for s in self.seqs)


def plan_width(seqs: list[ActiveSeq], ctx: StepContext, num_drafts: int) -> int:
    """A plan's drafts: each arm's width for its sequences (a chain's step width, a block's
    gamma), the least of them, within what each drafting sequence's drafter gives (a block
    drafter's block less one), since a plan proposes one count for all of them."""
    blocks = [a for a in seqs if a.method.arm == BLOCKS]
    widths = [block_width(blocks, ctx, num_drafts)] if blocks else []
    if len(blocks) < len(seqs):
        widths.append(step_width(seqs, ctx, num_drafts))
    most = [a.method.most_drafts(ctx.caps) for a in seqs if a.method.drafts]
    return min([*widths, *most])


def context_left(a: ActiveSeq) -> int:
    """Tokens a sequence's context may still take."""
    return a.max_context - len(a.req.prompt_ids) - len(a.generated)


@dataclass
class Pipeline:
    """The flights of one connection, and the sequences whose frees wait for them."""

    release: Callable[[SequenceHandle], None]  # frees a sequence on the service
    read_back: Callable[[float], None]  # each result's `waited_s`, for the counters
    stream: StepStream | None = None
    flights: deque[SentStep] = field(default_factory=deque)
    deferred: list[tuple[ActiveSeq, SequenceHandle]] = field(default_factory=list)
    last_read: float = 0.0  # when the last result came back

    def holds(self, a: ActiveSeq) -> bool:
        """A plan in flight names the sequence: freeing it must wait for that result."""
        return any(f.holds(a) for f in self.flights)

    def free(self, a: ActiveSeq) -> None:
        """Release the request's sequence, or, while a plan in flight still runs it, once
        that plan's result is back."""
        handle, a.handle = a.handle, None
        if handle is None:
            return
        if self.holds(a):
            self.deferred.append((a, handle))
        else:
            self.release(handle)

    def fits(self, seqs: list[ActiveSeq], ctx: StepContext, num_drafts: int) -> list[ActiveSeq]:
        """The longest prefix of `seqs` one plan can carry at the width it would get (rows
        and batch bounds); fewer sequences may get a wider step, so the width is taken again
        for each cut."""
        out = seqs[: ctx.caps.max_batch]
        while out:
            rows = plan_width(out, ctx, num_drafts) + 1
            if len(out) * rows <= ctx.caps.max_rows:
                break
            out = out[: min(len(out) - 1, ctx.caps.max_rows // rows)]
        return out

    def step(
        self,
        model: ServingModel,
        active: list[ActiveSeq],
        ctx: StepContext,
        joining: bool,
        stepped: Callable[[int, int, bool, int], None],
    ) -> None:
        """One step of every sequence of `active`: those that run ahead through the pipeline,
        the others the synchronous way (`step_mtp`), each step told to `stepped` (its
        sequences, prompt-lookup copies, whether D-Cut cut, its width). While requests wait
        to join (`joining`), a plan carries one step: a plan runs whole."""
        num_drafts, plan_steps = ctx.opts.num_drafts, ctx.opts.plan_steps
        ctx.chooser.choose(active, ctx.caps, num_drafts, ctx.opts.mtp_max_seqs)
        ahead = self.fits([a for a in active if runs_ahead(a, ctx)], ctx, num_drafts)
        rest = [a for a in active if not any(a is b for b in ahead)]
        if rest or (self.flights and not ahead):
            # Nothing runs ahead beside a synchronous step: its verify and its verdict may be
            # two calls, and a plan run between them would no longer leave its verify last.
            self.drain(ctx)
            # One that ran ahead until now (the server's choice gave it a method that does not)
            # may have finished in what the drain read: it steps no further.
            rest = [a for a in rest if a.finished is None]
        if ahead:
            alone = not (rest or joining)
            n, step_nd = self.advance(
                model,
                ahead,
                ctx,
                num_drafts,
                ahead_by=0 if rest else 1,
                plan_steps=plan_steps if alone else 1,
            )
            stepped(n, 0, False, step_nd)
        if rest:
            report = step_mtp(model, rest, ctx, num_drafts)
            stepped(len(rest), sum(report.copied), report.dcut, report.ladder_nd)
        ctx.chooser.observe(active)

    def advance(
        self,
        model: ServingModel,
        seqs: list[ActiveSeq],
        ctx: StepContext,
        num_drafts: int,
        ahead_by: int = 1,
        plan_steps: int = 1,
    ) -> tuple[int, int]:
        """Send plans for `seqs` until more than `ahead_by` plans are in flight (none when
        there are already), each of up to `plan_steps` steps, then read the oldest step's
        result back. -> (its sequences, its width).

        Counted in plans, not steps: over gRPC a plan's results come back in one message
        once its last step ends, so the service keeps busy only while the plan after it is
        already there."""
        if self.stream is None:
            self.stream = model.open_steps()
        while self.plans_in_flight() <= ahead_by:
            self._send(seqs, ctx, num_drafts, plan_steps)
        return self._read(ctx)

    def plans_in_flight(self) -> int:
        return sum(f.ends_plan for f in self.flights)

    def drain(self, ctx: StepContext | None) -> None:
        """Read every flight back: nothing runs ahead any more."""
        while self.flights:
            self._read(ctx)
        self._free_deferred()

    def close(self) -> None:
        """The connection is gone: the flights and the deferred frees with it."""
        for f in self.flights:
            f.span.end()
        self.flights.clear()
        self.deferred.clear()
        if self.stream is not None:
            stream, self.stream = self.stream, None
            stream.close()

    def _send(
        self, seqs: list[ActiveSeq], ctx: StepContext, num_drafts: int, plan_steps: int
    ) -> None:
        assert self.stream is not None
        last = self.flights[-1] if self.flights else None
        step_nd = plan_width(seqs, ctx, num_drafts)
        continues = [last is not None and last.holds(a) for a in seqs]
        # Several steps in one plan only where each is a plain continuation, and none can
        # outrun a sequence's context even if every draft of every step in flight stands. (A
        # sequence that meets its length or a stop before the last step wastes the rest of
        # its rows, as a sequence finishing in a plan sent ahead does.)
        steps = plan_steps
        if steps > 1 and not all(continues):
            steps = 1
        if steps > 1:
            need = (len(self.flights) + steps) * (step_nd + 1)
            steps = steps if all(context_left(a) >= need for a in seqs) else 1
        tokens, ks = [], []
        o = ctx.opts
        cut = o.dcut and step_nd >= 2 and len(seqs) <= o.dcut_width_cap
        for a, cont in zip(seqs, continues, strict=True):
            cap = min(step_nd, a.req.num_drafts if a.req.num_drafts is not None else step_nd)
            if cut and a.pending_conf:  # a continuing sequence's: those of the step before
                cap = min(cap, dcut_depth(a.pending_conf[:step_nd], o.dcut_threshold))
            if cont:
                ks.append(cap + 1)
            else:
                rows = [a.last_token, *a.pending_drafts[:cap]]
                tokens += rows
                ks.append(len(rows))
        spans, traces = _plan_spans(seqs, ctx, step_nd, steps)
        want = [step_nd >= 1 and a.wants_drafts for a in seqs]
        handles = [a.live_handle for a in seqs]
        self.stream.send(
            StepPlan(
                handles,
                continues,
                tokens,
                ks,
                want,
                step_nd,
                traces[0],
                steps,
                traces[1:],
                drafter_names(seqs),
            )
        )
        for a in seqs:
            a.stats.steps += steps
        sent = time.perf_counter()
        for j, sp in enumerate(spans):
            self.flights.append(SentStep(list(seqs), step_nd, sp, sent, steps, j == steps - 1))

    def _read(self, ctx: StepContext | None) -> tuple[int, int]:
        assert self.stream is not None
        result = self.stream.recv()  # a lost stream raises: `close` ends what is in flight
        flight = self.flights.popleft()
        self.read_back(result.waited_s)
        _apply(flight, result, ctx)
        if flight.ends_plan:
            # What a step cost as served: back to back, the time between the ends of two
            # plans; a plan sent after the last one ended, its round trip; per step.
            now = time.perf_counter()
            served_ms = (now - max(self.last_read, flight.sent)) * 1e3 / flight.plan_steps
            self.last_read = now
            if ctx is not None:
                ctx.overhead.observe(ctx.costs, len(flight.seqs), flight.step_nd, served_ms)
        self._free_deferred()
        return len(flight.seqs), flight.step_nd

    def _free_deferred(self) -> None:
        waiting = []
        for a, handle in self.deferred:
            if self.holds(a):
                waiting.append((a, handle))
            else:
                self.release(handle)
        self.deferred = waiting


def _plan_spans(
    seqs: list[ActiveSeq], ctx: StepContext, step_nd: int, steps: int
) -> tuple[list[Span], list[dict[str, str]]]:
    """Each step's span of a plan, linked to its requests', and its trace context."""
    links = [Link(a.req.span_context) for a in seqs if a.req.span_context is not None]
    spans = [TRACER.start_span("step_mtp", links=links) for _ in range(steps)]
    for sp in spans:
        sp.set_attributes(
            {
                "met.active": len(seqs),
                "met.ladder_nd": step_nd,
                "met.pipelined": True,
                "met.plan_steps": steps,
                "met.methods": [a.method.name for a in seqs],
                "met.choice": str(ctx.chooser.current or ""),
                REPLICA_ATTRIBUTE: ctx.replica,
            }
        )
    traces: list[dict[str, str]] = [{} for _ in spans]
    for trace, sp in zip(traces, spans, strict=True):
        propagate.inject(trace, context=set_span_in_context(sp))
    return spans, traces


def _select(result: PlanResult, keep: list[int]) -> StepResult:
    """The step's result for the ran sequences at `keep` (indexes into `result.ran`)."""
    step, off = result.step, offsets(result.ks)
    rows = [r for j in keep for r in range(off[j], off[j + 1])]
    where = {j: n for n, j in enumerate(step.proposers)}
    props = [where[j] for j in keep if j in where]
    return StepResult(
        [step.argmax[r] for r in rows],
        [step.logprobs[r] for r in rows],
        [step.accepted[j] for j in keep],
        [n for n, j in enumerate(keep) if j in where],
        Proposal(
            [step.proposal.drafts[p] for p in props],
            [step.proposal.confidences[p] for p in props],
        ),
    )


def _apply(flight: SentStep, result: PlanResult, ctx: StepContext | None) -> None:
    """The result on the sequences still running; a finished one's part is dropped."""
    refused = {i: (code, message) for i, code, message in result.refused}
    for i, (code, message) in refused.items():
        a = flight.seqs[i]
        if a.finished is None:
            a.refuse(code, message)
    keep = [j for j, i in enumerate(result.ran) if flight.seqs[i].finished is None]
    rows, off = [], 0
    for k in result.ks:
        rows.append(result.rows[off : off + k])
        off += k
    seqs = [flight.seqs[result.ran[j]] for j in keep]
    # Counted here, not when the plan went out: the steps before it were read since.
    before = [(a.stats.drafted, a.stats.accepted) for a in seqs]
    if seqs:
        apply_step(seqs, [rows[j] for j in keep], _select(result, keep), flight.step_nd)
    flight.span.set_attributes(
        {"met.accepted": [result.step.accepted[j] for j in keep], "met.refused": len(refused)}
    )
    flight.span.end()
    if ctx is None:
        return
    for a, (d, n) in zip(seqs, before, strict=True):
        ctx.rung.observe(a.stats.drafted - d, a.stats.accepted - n)
        ctx.calibration.observe(a.stats.drafted - d, a.stats.accepted - n)
