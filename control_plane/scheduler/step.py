"""`step_mtp`: one speculative step over the active sequences.

Invariants:
- on entry every sequence is either bootstrap (no drafts pending) or verify (drafts pending);
- the step's draft width `ladder_nd` never exceeds the smallest verify-slot capacity among
  the active sequences (a draft past it has no verify row);
- with more active sequences than `--mtp-max-seqs` the width is 0 and the step decodes
  plainly, whichever source (static ladder, adaptive rung, cost model) sets it otherwise:
  the cap bounds the cost of a step, so no width source may step over it (the DFlash arm
  resolves its gamma by its own ladder and is not capped).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from opentelemetry.trace import Link

from control_plane.scheduler import dcut
from control_plane.scheduler.batch_verify import (
    canonical_assignment,
    chunk_ranges,
    step_verify_batched,
    verify_batch_permutation,
)
from control_plane.scheduler.bootstrap import bootstrap, bootstrap_serial
from control_plane.scheduler.context import StepContext
from control_plane.scheduler.cost_model import propose_depth
from control_plane.scheduler.dflash import step_dflash
from control_plane.scheduler.ladder import clamp_drafts_to_slot_capacity
from control_plane.scheduler.metrics import REPLICA_ATTRIBUTE
from control_plane.scheduler.prompt_lookup import offer_copy, settle_copies
from control_plane.scheduler.seq import ActiveSeq
from control_plane.scheduler.serial_verify import serial_verify_plan, step_verify_serial
from protos.model import ServingModel
from protos.params import MTP, PROMPT_LOOKUP
from protos.telemetry import span, tracer

TRACER = tracer("met.control_plane")


@dataclass
class StepReport:
    """What a step did, for stats and traces."""

    ladder_nd: int = 0
    bootstrap: str = ""  # "batched", "serial" or ""
    batched_calls: list[list[int]] = field(default_factory=list)  # ks of each batched call
    serial_arms: list[str] = field(default_factory=list)
    copied: list[bool] = field(default_factory=list)  # per active sequence: a copy verified
    dcut: bool = False  # D-Cut planned the batch's depths
    dflash_declined: bool = False  # the service refused the DFlash batch: all went serial


def split(active: list[ActiveSeq]) -> tuple[list[int], list[int]]:
    """(bootstrap, verify) indices: no drafts pending, drafts pending."""
    boot = [i for i, a in enumerate(active) if not a.pending_drafts]
    verify = [i for i, a in enumerate(active) if a.pending_drafts]
    return boot, verify


def step_width(active: list[ActiveSeq], ctx: StepContext, num_drafts: int) -> int:
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


def step_mtp(
    model: ServingModel, active: list[ActiveSeq], ctx: StepContext, num_drafts: int
) -> StepReport:
    """One span over the whole step (its outer timing), linked to every request it
    served; then the width sources learn the step's acceptance."""
    links = [Link(a.req.span_context) for a in active if a.req.span_context is not None]
    before = [(a.stats.drafted, a.stats.accepted) for a in active]
    attrs = {REPLICA_ATTRIBUTE: ctx.replica}
    with TRACER.start_as_current_span("step_mtp", links=links, attributes=attrs) as sp:
        started = time.perf_counter()
        report = _step(model, active, ctx, num_drafts)
        if not ctx.opts.dflash:
            served_ms = (time.perf_counter() - started) * 1e3
            ctx.overhead.observe(ctx.costs, len(active), report.ladder_nd, served_ms)
        for a, (d, n), copied in zip(active, before, report.copied, strict=True):
            if not copied:
                ctx.rung.observe(a.stats.drafted - d, a.stats.accepted - n)
                ctx.calibration.observe(a.stats.drafted - d, a.stats.accepted - n)
        sp.set_attributes(
            {
                "met.active": len(active),
                "met.ladder_nd": report.ladder_nd,
                "met.drafted": sum(
                    a.stats.drafted - d for a, (d, _) in zip(active, before, strict=True)
                ),
                "met.accepted": sum(
                    a.stats.accepted - n for a, (_, n) in zip(active, before, strict=True)
                ),
                "met.batched_calls": len(report.batched_calls),
                "met.serial_arms": report.serial_arms,
                "met.copies": sum(report.copied),
                "met.dcut": report.dcut,
            }
        )
    return report


def _step(
    model: ServingModel, active: list[ActiveSeq], ctx: StepContext, num_drafts: int
) -> StepReport:
    if ctx.opts.dflash:
        return _step_dflash(model, active, ctx, num_drafts)
    report = StepReport(ladder_nd=step_width(active, ctx, num_drafts))
    ladder_nd = report.ladder_nd
    for a in active:
        a.stats.steps += 1
    # Prompt-lookup requests draft only copies: with one they verify it, else decode plainly.
    _copies(active, ctx, [i for i, a in enumerate(active) if a.req.method == PROMPT_LOOKUP])
    boot, verify = split(active)
    if boot:
        report.bootstrap = bootstrap(model, [active[i] for i in boot], ctx, ladder_nd)
    if ctx.opts.prompt_lookup:
        _copies(active, ctx, [i for i in verify if active[i].req.method == MTP])
    report.copied = [a.copy > 0 for a in active]
    serial, batchable, copies = _partition(active, verify, ctx, ladder_nd)
    serial += _verify_batched(model, active, batchable, copies, ctx, report)
    for i in serial:
        _serial(model, active[i], ladder_nd, ctx.opts.fused_step, report)
    settle_copies(active)
    return report


def _verify_batched(
    model: ServingModel,
    active: list[ActiveSeq],
    batchable: list[int],
    copies: list[int],
    ctx: StepContext,
    report: StepReport,
) -> list[int]:
    """D-Cut's depths, then the batch in chunks the service accepts, each chunk in its
    dispatch order. -> the sequences of the chunks that cannot batch (they go serial)."""
    ladder_nd, o = report.ladder_nd, ctx.opts
    with span(TRACER, "dcut", **{"met.sequences": len(batchable)}) as sp:
        ks, report.dcut = dcut.plan(
            active, batchable, ladder_nd, o.dcut, o.dcut_threshold, o.dcut_width_cap
        )
        sp.set_attribute("met.dcut.ks", ks)
    for i in copies:
        batchable.append(i)
        ks.append(len(active[i].pending_drafts) + 1)
    canonical = canonical_assignment(len(batchable), report.dcut or bool(copies))
    serial = []
    for lo, hi in chunk_ranges(ks, ctx.caps.max_rows, ctx.caps.max_batch):
        chunk, chunk_ks = batchable[lo:hi], ks[lo:hi]
        if len(chunk) < 2:  # `chunk_ranges` keeps every chunk within the budget
            serial.extend(chunk)
            continue
        order = verify_batch_permutation([active[i].slot for i in chunk], chunk_ks, canonical)
        seqs, seq_ks = [active[chunk[p]] for p in order], [chunk_ks[p] for p in order]
        report.batched_calls.append(seq_ks)
        step_verify_batched(model, seqs, seq_ks, ladder_nd, o.fused_step)
    return serial


def _step_dflash(
    model: ServingModel, active: list[ActiveSeq], ctx: StepContext, num_drafts: int
) -> StepReport:
    """The DFlash arm: gamma from the resolver (it shadows the serve-wide count), the
    bootstrap, then the DFlash verify; no prompt lookup, no D-Cut (its drafts come as one
    block, so there is no chain to copy into or to cut)."""
    gamma = ctx.dflash_rung.drafts_for(len(active), num_drafts)
    width = clamp_drafts_to_slot_capacity(gamma, (ctx.capacity(a.slot) for a in active))
    report = StepReport(ladder_nd=width, copied=[False] * len(active))
    for a in active:
        a.stats.steps += 1
    boot, verify = split(active)
    if boot:
        report.bootstrap = bootstrap(model, [active[i] for i in boot], ctx, width)
    step_dflash(model, active, verify, width, ctx.opts, ctx.caps, report)
    return report


def _copies(active: list[ActiveSeq], ctx: StepContext, idxs: list[int]) -> None:
    if not idxs:
        return
    with span(TRACER, "prompt_lookup", **{"met.sequences": len(idxs)}) as sp:
        found = sum(offer_copy(active[i], ctx.capacity(active[i].slot)) for i in idxs)
        sp.set_attribute("met.copies", found)


def _partition(
    active: list[ActiveSeq], verify: list[int], ctx: StepContext, ladder_nd: int
) -> tuple[list[int], list[int], list[int]]:
    """(serial, batchable, copies): a batch needs two sequences with drafts, `--mtp-max-seqs`
    > 1 and the lever on; a copy joins it at its own depth; any other sequence batches with
    at most `ladder_nd` drafts, more being cut.

    A sequence holding fewer than `ladder_nd` joins the batch at its own depth, never
    alone: every sequence holds fewer the step after the width grows (its drafts were made
    at the old width), and so does one near its token budget; verifying those one at a time
    turned whole steps serial."""
    if not (
        len(verify) >= 2 and ctx.opts.mtp_max_seqs > 1 and ctx.opts.batch_verify and ladder_nd >= 1
    ):
        return list(verify), [], []  # grammar sequences are always among the serial
    serial, batchable, copies = [], [], []
    for i in verify:
        a = active[i]
        if a.grammar is not None:
            serial.append(i)
        elif a.copy:
            copies.append(i)
        else:
            del a.pending_drafts[ladder_nd:]
            del a.pending_conf[ladder_nd:]
            batchable.append(i)
    return serial, batchable, copies


def _serial(
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
        # Drafts with no room this step (the width fell to 0): verify the last token alone.
        report.serial_arms.append("K1")
        bootstrap_serial(model, a, ladder_nd, fused)
        return
    report.serial_arms.append(arm)
    step_verify_serial(model, a, a.pending_drafts, ladder_nd, fused)
