"""`step_mtp`: one speculative step over the active sequences, and its arms.

A step, top to bottom: the width (`widths.py`'s sources, `step_width`); prompt-lookup copies
for the requests that draft only those; the bootstrap of the sequences with no drafts pending
(a one-token verify, its verdict and their first drafts); copies for MTP sequences whose
history repeats (`--prompt-lookup`); the batched verify of those that batch; the serial verify
of the rest. Every arm ends in `verdict.verify_and_settle`: one verify call, its verdict (the
tokens that stand), and the drafts for the next step at the step's width. Requests with method
`dflash` (every speculative one with `--dflash`) take the DFlash arm (`arm_dflash.py`) in the
same step; the bootstrap is `bootstrap.py`'s.

Invariants:
- on entry every sequence is either bootstrap (no drafts pending) or verify (drafts pending);
- the step's draft width `ladder_nd` never exceeds the smallest verify-slot capacity among
  the active sequences (a draft past it has no verify row);
- with more active sequences than `--mtp-max-seqs` the width is 0 and the step decodes
  plainly, whichever source (static ladder, adaptive rung, cost model) sets it otherwise:
  the cap bounds the cost of a step, so no width source may step over it (the DFlash arm
  resolves its gamma by its own ladder and is not capped).

Prompt lookup: drafts copied from the sequence's own history. The last `n` tokens of the
history (prompt, then generated, ending with the token about to be verified) are looked up at
their most recent earlier occurrence, for `n` in `NGRAM_SIZES`, longest first; the tokens that
followed it are the copy, at most `max_len` of them (1..3, within the slot's capacity). A copy
replaces the MTP chain for one step: it stays out of D-Cut, joins the batch at its own depth,
picks its serial arm by its own length, and the propose after its verdict still uses the
step's width. `prompt_lookup` requests draft only copies and decode plainly when none matches.

Batched verify: `chunk_ranges(ks, max_rows, max_batch)` cuts the batch into consecutive
ranges, greedily as long as possible, each within the row budget (sum of k) and the stash
width (sequences per call). `canonical_assignment(n, dcut)`: whether a batch of `n` uses the
canonical order; it is canonical whenever no depth planning reordered it (`dcut` false): a
uniform batch, or one whose ragged depths come from the drafts each sequence holds (made at an
older width, or near its token budget). A batch that D-Cut planned, or that copies joined at
their own depths, is not, and goes deepest first. It is asked with the width of the whole
batch, never a chunk's, so a chunked batch keeps the order its depths were planned under.
`verify_batch_permutation(slots, depths, canonical)`: canonical: ascending slot; otherwise
deepest first, then slot. The active index breaks ties, so the order is total.

Serial verify: one call per sequence. `serial_verify_plan(held, step_nd)` keeps
`min(held, step_nd)` drafts (the drafter's chain length this step) and verifies them with
`k = kept + 1` rows. The arm is named by its row count (K2, K3, K4 for 1, 2, 3 drafts, KN for
more) in stats and traces; every arm is the same verify with one sequence.

"""

from __future__ import annotations

import time

from opentelemetry.trace import Link
from opentelemetry.util.types import AttributeValue

from control_plane.scheduler.arm_dflash import step_dflash
from control_plane.scheduler.bootstrap import (
    StepReport,
    bootstrap,
    bootstrap_serial,
    chunk_ranges,
    split,
)
from control_plane.scheduler.context import StepContext
from control_plane.scheduler.methods import BLOCKS, LOOKUP, MAX_COPY, Method, method
from control_plane.scheduler.metrics import REPLICA_ATTRIBUTE
from control_plane.scheduler.seq import ActiveSeq
from control_plane.scheduler.verdict import verify_and_settle
from control_plane.scheduler.widths import (
    clamp_drafts_to_slot_capacity,
    dcut_plan,
    propose_depth,
)
from protos.model import ServingModel
from protos.telemetry import span, tracer

TRACER = tracer("met.control_plane")


def step_mtp(
    model: ServingModel, active: list[ActiveSeq], ctx: StepContext, num_drafts: int
) -> StepReport:
    """One step of every sequence of `active`: each verifies the drafts it holds (with none,
    its newest token alone), keeps the tokens that stand and drafts for the next step. One
    span over the whole step (its outer timing), linked to every request it served; then the
    width sources learn the step's acceptance."""
    links = [Link(a.req.span_context) for a in active if a.req.span_context is not None]
    before = [(a.stats.drafted, a.stats.accepted) for a in active]
    attrs = {REPLICA_ATTRIBUTE: ctx.replica}
    with TRACER.start_as_current_span("step_mtp", links=links, attributes=attrs) as sp:
        for a in active:
            a.stats.steps += 1
        blocks = [i for i, a in enumerate(active) if _arm(a, ctx) == BLOCKS]
        heads = [i for i in range(len(active)) if i not in set(blocks)]
        report = StepReport(copied=[False] * len(active))
        if heads:
            part = _step_heads(model, [active[i] for i in heads], ctx, num_drafts)
            report.merge(part)
            for j, i in enumerate(heads):
                report.copied[i] = part.copied[j]
        if blocks:
            report.merge(step_dflash(model, [active[i] for i in blocks], ctx, num_drafts))
        sp.set_attributes(_learn(active, before, report, ctx))
    return report


def _step_heads(
    model: ServingModel, active: list[ActiveSeq], ctx: StepContext, num_drafts: int
) -> StepReport:
    """The sequences the MTP head (or prompt lookup) drafts for, or that decode plainly."""
    started = time.perf_counter()
    report = StepReport(ladder_nd=step_width(active, ctx, num_drafts))
    nd, fused = report.ladder_nd, ctx.opts.fused_step
    # Prompt-lookup requests draft only copies: with one they verify it, else they
    # decode plainly.
    _copies(active, ctx, [i for i, a in enumerate(active) if a.method.copies])
    boot, verify = split(active)
    if boot:
        report.bootstrap = bootstrap(model, [active[i] for i in boot], ctx, nd)
    if ctx.opts.prompt_lookup:  # a repeat in its history stands in for the MTP chain
        _copies(active, ctx, [i for i in verify if active[i].method.stands_in])
    report.copied = [a.copy > 0 for a in active]
    serial, batchable, joiners = _partition(active, verify, ctx, nd)
    serial += _verify_batched(model, active, batchable, joiners, ctx, report)
    for i in serial:
        _verify_serial(model, active[i], nd, fused, report)
    for a in active:
        a.copy = 0  # a copy serves one step
    served_ms = (time.perf_counter() - started) * 1e3
    ctx.overhead.observe(ctx.costs, len(active), nd, served_ms)
    return report


def _learn(
    active: list[ActiveSeq], before: list[tuple[int, int]], report: StepReport, ctx: StepContext
) -> dict[str, AttributeValue]:
    """The rung and the calibration learn the acceptance of the drafts the drafter made (a
    copy's say nothing of it). -> the step span's attributes"""
    drafted = accepted = 0
    for a, (d, n), copied in zip(active, before, report.copied, strict=True):
        drafted, accepted = drafted + a.stats.drafted - d, accepted + a.stats.accepted - n
        if not copied and method(a.drafted_by).teaches_widths:
            ctx.rung.observe(a.stats.drafted - d, a.stats.accepted - n)
            ctx.calibration.observe(a.stats.drafted - d, a.stats.accepted - n)
    return {
        "met.active": len(active),
        "met.ladder_nd": report.ladder_nd,
        "met.drafted": drafted,
        "met.accepted": accepted,
        "met.batched_calls": len(report.batched_calls),
        "met.serial_arms": report.serial_arms,
        "met.copies": sum(report.copied),
        "met.dcut": report.dcut,
        # What each sequence ran, and the server's choice for those that leave it to it.
        "met.methods": [a.method.name for a in active],
        "met.choice": str(ctx.chooser.current or ""),
    }


def _arm(a: ActiveSeq, ctx: StepContext) -> str:
    """The arm that verifies it: its method's; with `--dflash` every drafting request's is the
    block drafter's (the MTP head's drafts planned as a block's would be)."""
    return BLOCKS if ctx.opts.dflash and a.method.drafts else a.method.arm


# -- the width -----------------------------------------------------------------------------


def step_width(active: list[ActiveSeq], ctx: StepContext, num_drafts: int) -> int:
    """The step's drafts: 0 past `--mtp-max-seqs`; else the cost model's depth, or the
    rung's, whichever method chose the chain (a request, or the server's choice); never past
    the smallest verify-slot capacity."""
    n = len(active)
    if n > ctx.opts.mtp_max_seqs or num_drafts <= 0:
        nd = 0
    elif ctx.costs is not None and not ctx.opts.fixed_width:
        nd = _measured_width(n, ctx, num_drafts)
    else:
        nd = ctx.rung.drafts_for(n, num_drafts)
    return clamp_drafts_to_slot_capacity(nd, (ctx.capacity(a.slot) for a in active))


def _measured_width(n: int, ctx: StepContext, num_drafts: int) -> int:
    """The cost model's depth within the cap, floored to 1 as the ladder's is: a model
    that prefers no draft does not suspend drafting (`--num-drafts 0` does)."""
    assert ctx.costs is not None
    overhead = ctx.overhead.ms
    with span(TRACER, "cost_model", **{"met.active": n, "met.overhead_ms": overhead}) as sp:
        depth = propose_depth(
            ctx.costs,
            ctx.calibration,
            n,
            ctx.opts.spec_cost_slack,
            ctx.opts.mtp_max_seqs,
            num_drafts,
            overhead,
        )
        sp.set_attribute("met.depth", depth)
    return min(max(depth, 1), num_drafts)


# -- prompt-lookup copies ------------------------------------------------------------------


def offer_copy(a: ActiveSeq, capacity: int, copier: Method = LOOKUP) -> bool:
    """Give the sequence `copier`'s drafts for this step, when it makes some (prompt lookup:
    when its history repeats)."""
    most = min(MAX_COPY, capacity, a.remaining - 1)
    # Copies are point masses, which the service's residuals do not model: greedy only.
    if most < 1 or a.grammar is not None or a.samples:
        return False
    copy = copier.copy([*a.req.prompt_ids, *a.generated], most)[:most]
    if not copy:
        return False
    a.pending_drafts, a.pending_conf, a.copy = copy, [1.0] * len(copy), len(copy)
    a.drafted_by = copier.name
    return True


def _copies(active: list[ActiveSeq], ctx: StepContext, idxs: list[int]) -> None:
    if not idxs:
        return
    with span(TRACER, "prompt_lookup", **{"met.sequences": len(idxs)}) as sp:
        found = 0
        for i in idxs:
            a = active[i]  # a method's own copies, else prompt lookup's standing in for its chain
            copier = a.method if a.method.copies else LOOKUP
            found += offer_copy(a, ctx.capacity(a.slot), copier)
        sp.set_attribute("met.copies", found)


# -- batched verify ------------------------------------------------------------------------


def _partition(
    active: list[ActiveSeq], verify: list[int], ctx: StepContext, ladder_nd: int
) -> tuple[list[int], list[int], list[int]]:
    """(serial, batchable, joiners): a batch needs two sequences with drafts, `--mtp-max-seqs`
    > 1 and the lever on. Every sequence's drafts are first cut before the first one its
    grammar refuses (or, for one not constraining yet, would), then past `ladder_nd`. A copy,
    and a constrained sequence, joins the batch at its own depth (a constrained one with its
    rows' masks; with every draft cut, as a one-row verify): D-Cut plans neither, a copy being
    a point mass and a grammar's cut already the depth that can stand.

    A sequence holding fewer than `ladder_nd` joins the batch at its own depth, never
    alone: every sequence holds fewer the step after the width grows (its drafts were made
    at the old width), and so does one near its token budget; verified one at a time, they
    would turn whole steps serial."""
    if not (
        len(verify) >= 2 and ctx.opts.mtp_max_seqs > 1 and ctx.opts.batch_verify and ladder_nd >= 1
    ):
        return list(verify), [], []
    serial: list[int] = []
    batchable: list[int] = []
    joiners: list[int] = []
    for i in verify:
        a = active[i]
        a.cut_drafts()
        if a.copy:
            joiners.append(i)
            continue
        del a.pending_drafts[ladder_nd:]
        del a.pending_conf[ladder_nd:]
        (joiners if a.constrained else batchable).append(i)
    return serial, batchable, joiners


def _verify_batched(
    model: ServingModel,
    active: list[ActiveSeq],
    batchable: list[int],
    joiners: list[int],
    ctx: StepContext,
    report: StepReport,
) -> list[int]:
    """D-Cut's depths, then the batch in chunks the service accepts, each chunk in its
    dispatch order, each call's rows `[last, drafts[:k-1]]`. -> the sequences of the chunks
    that cannot batch (they go serial)."""
    ladder_nd, o = report.ladder_nd, ctx.opts
    with span(TRACER, "dcut", **{"met.sequences": len(batchable)}) as sp:
        ks, report.dcut = dcut_plan(
            active, batchable, ladder_nd, o.dcut, o.dcut_threshold, o.dcut_width_cap
        )
        sp.set_attribute("met.dcut.ks", ks)
    for i in joiners:
        batchable.append(i)
        ks.append(len(active[i].pending_drafts) + 1)
    canonical = canonical_assignment(len(batchable), report.dcut or bool(joiners))
    serial = []
    for lo, hi in chunk_ranges(ks, ctx.caps.max_rows, ctx.caps.max_batch):
        chunk, chunk_ks = batchable[lo:hi], ks[lo:hi]
        if len(chunk) < 2:  # `chunk_ranges` keeps every chunk within the budget
            serial.extend(chunk)
            continue
        order = verify_batch_permutation([active[i].slot for i in chunk], chunk_ks, canonical)
        seqs, seq_ks = [active[chunk[p]] for p in order], [chunk_ks[p] for p in order]
        report.batched_calls.append(seq_ks)
        rows = [
            [a.last_token, *a.pending_drafts[: k - 1]] for a, k in zip(seqs, seq_ks, strict=True)
        ]
        verify_and_settle(model, seqs, rows, ladder_nd, "batched", o.fused_step)
    return serial


def canonical_assignment(batch_n: int, dcut: bool = False) -> bool:
    return not dcut or batch_n < 2


def verify_batch_permutation(slots: list[int], depths: list[int], canonical: bool) -> list[int]:
    idx = range(len(slots))
    if canonical:
        return sorted(idx, key=lambda i: (slots[i], i))
    return sorted(idx, key=lambda i: (-depths[i], slots[i], i))


# -- serial verify -------------------------------------------------------------------------


def serial_verify_plan(held: int, step_nd: int) -> tuple[int, str]:
    keep = max(0, min(held, step_nd))
    return keep, {1: "K2", 2: "K3", 3: "K4"}.get(keep, "KN" if keep else "none")


def _verify_serial(
    model: ServingModel, a: ActiveSeq, ladder_nd: int, fused: bool, report: StepReport
) -> None:
    drafts = a.pending_drafts
    if a.grammar is not None:
        # Keep only the drafts before the first one the grammar would reject.
        with span(TRACER, "grammar", **{"met.drafts": len(drafts)}) as sp:
            kept = a.grammar.valid_prefix(drafts)
            sp.set_attribute("met.kept", kept)
        if kept < len(drafts):
            a.stats.grammar_truncations += 1
            drafts = drafts[:kept]
    # A copy picks its arm by its own length; ladder_nd stays the chain length to propose.
    keep, arm = serial_verify_plan(len(drafts), a.copy or ladder_nd)
    # The verify reads the kept drafts' confidences (sampling's q) from the sequence.
    a.pending_drafts, a.pending_conf = drafts[:keep], a.pending_conf[:keep]
    if keep == 0:
        # Drafts with no space this step (the width fell to 0): verify the last token alone.
        report.serial_arms.append("K1")
        bootstrap_serial(model, a, ladder_nd, fused)
        return
    report.serial_arms.append(arm)
    verify_and_settle(model, [a], [[a.last_token, *a.pending_drafts]], ladder_nd, "serial", fused)
