"""`step_mtp`: one speculative step over the active sequences, and its arms.

A step, top to bottom: the width (`widths.py`'s sources, `step_width`); prompt-lookup copies
for the requests that draft only those; the bootstrap of the sequences with no drafts pending
(a one-token verify, its verdict and their first drafts); copies for MTP sequences whose
history repeats (`--prompt-lookup`); the batched verify of those that batch; the serial verify
of the rest. Every arm ends in `verdict.verify_and_settle`: one verify call, its verdict (the
tokens that stand), and the drafts for the next step at the step's width. With a DFlash
drafter the step takes the DFlash arm instead (`_step_dflash`).

Invariants:
- on entry every sequence is either bootstrap (no drafts pending) or verify (drafts pending);
- the step's draft width `ladder_nd` never exceeds the smallest verify-slot capacity among
  the active sequences (a draft past it has no verify row);
- with more active sequences than `--mtp-max-seqs` the width is 0 and the step decodes
  plainly, whichever source (static ladder, adaptive rung, cost model) sets it otherwise:
  the cap bounds the cost of a step, so no width source may step over it (the DFlash arm
  resolves its gamma by its own ladder and is not capped).

Bootstrap: batched when at least two sequences bootstrap, the `batch_bootstrap` lever is on
and one call of that many one-row sequences fits the service's budget (`fits_batch`);
otherwise each sequence bootstraps alone.

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

The DFlash arm (planning only; the block drafter itself comes later): every sequence proposes
`gamma` drafts at once (`widths.DFlashRung`) and the verify keeps the raw argmax; no prompt
lookup, no D-Cut (its drafts come as one block, so there is no chain to copy into or to cut).
Batched verify: two or more sequences with drafts, the `dflash_batch_verify` and
`batch_verify` levers on. The batch is every sequence without a grammar whose draft count
equals the first such sequence's (gamma); the rest go serial. `m_max` is the widest group the
service's budget (`fits_batch`) takes at `gamma + 1` rows, shrinking from the whole group; the
group, in slot order, is verified in chunks of `m_max`; a trailing single goes serial. A group
the budget cannot take two of goes serial whole. The verify (and the propose after its
verdict) runs at the resolver's gamma clamped to the smallest verify-slot capacity, as the
bootstrap's is: an unclamped gamma could give a sequence more drafts than its slot can verify
next step, a verify the service refuses, so one width, clamped, serves the whole step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from opentelemetry.trace import Link
from opentelemetry.util.types import AttributeValue

from control_plane.scheduler.context import StepContext
from control_plane.scheduler.metrics import REPLICA_ATTRIBUTE
from control_plane.scheduler.seq import ActiveSeq
from control_plane.scheduler.verdict import verify_and_settle
from control_plane.scheduler.widths import (
    clamp_drafts_to_slot_capacity,
    dcut_plan,
    propose_depth,
)
from protos.model import Capabilities, ServingModel, fits_batch
from protos.params import MTP, PROMPT_LOOKUP
from protos.telemetry import span, tracer

TRACER = tracer("met.control_plane")
NGRAM_SIZES = (3, 2)
MAX_COPY = 3


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
        started = time.perf_counter()
        for a in active:
            a.stats.steps += 1
        if ctx.opts.dflash:
            report = _step_dflash(model, active, ctx, num_drafts)
        else:
            report = StepReport(ladder_nd=step_width(active, ctx, num_drafts))
            nd, fused = report.ladder_nd, ctx.opts.fused_step
            # Prompt-lookup requests draft only copies: with one they verify it, else they
            # decode plainly.
            _copies(active, ctx, [i for i, a in enumerate(active) if a.req.method == PROMPT_LOOKUP])
            boot, verify = split(active)
            if boot:
                report.bootstrap = bootstrap(model, [active[i] for i in boot], ctx, nd)
            if ctx.opts.prompt_lookup:  # a repeat in its history stands in for the MTP chain
                _copies(active, ctx, [i for i in verify if active[i].req.method == MTP])
            report.copied = [a.copy > 0 for a in active]
            serial, batchable, copies = _partition(active, verify, ctx, nd)
            serial += _verify_batched(model, active, batchable, copies, ctx, report)
            for i in serial:
                _verify_serial(model, active[i], nd, fused, report)
            for a in active:
                a.copy = 0  # a copy serves one step
            served_ms = (time.perf_counter() - started) * 1e3
            ctx.overhead.observe(ctx.costs, len(active), nd, served_ms)
        sp.set_attributes(_learn(active, before, report, ctx))
    return report


def _learn(
    active: list[ActiveSeq], before: list[tuple[int, int]], report: StepReport, ctx: StepContext
) -> dict[str, AttributeValue]:
    """The rung and the calibration learn the acceptance of the drafts the drafter made (a
    copy's say nothing of it). -> the step span's attributes"""
    drafted = accepted = 0
    for a, (d, n), copied in zip(active, before, report.copied, strict=True):
        drafted, accepted = drafted + a.stats.drafted - d, accepted + a.stats.accepted - n
        if not copied:
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
    }


def split(active: list[ActiveSeq]) -> tuple[list[int], list[int]]:
    """(bootstrap, verify) indices: no drafts pending, drafts pending."""
    boot = [i for i, a in enumerate(active) if not a.pending_drafts]
    verify = [i for i, a in enumerate(active) if a.pending_drafts]
    return boot, verify


# -- the width -----------------------------------------------------------------------------


def step_width(active: list[ActiveSeq], ctx: StepContext, num_drafts: int) -> int:
    """The step's drafts: 0 past `--mtp-max-seqs`; else the cost model's depth, or the rung's;
    never past the smallest verify-slot capacity."""
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


# -- bootstrap -----------------------------------------------------------------------------


def can_batch_bootstrap(ctx: StepContext, count: int) -> bool:
    return count >= 2 and ctx.opts.batch_bootstrap and fits_batch(ctx.caps, [1] * count)


def bootstrap(model: ServingModel, seqs: list[ActiveSeq], ctx: StepContext, ladder_nd: int) -> str:
    """Bootstrap `seqs`, proposing `ladder_nd` drafts each. -> "batched" or "serial"."""
    batched = can_batch_bootstrap(ctx, len(seqs))
    mode = "batched" if batched else "serial"
    fused = ctx.opts.fused_step
    attrs: dict[str, AttributeValue] = {"met.bootstrap.mode": mode, "met.sequences": len(seqs)}
    with span(TRACER, "bootstrap", **attrs):
        if batched:
            verify_and_settle(
                model, seqs, [[a.last_token] for a in seqs], ladder_nd, "bootstrap", fused
            )
        else:
            for a in seqs:
                bootstrap_serial(model, a, ladder_nd, fused)
    return mode


def bootstrap_serial(model: ServingModel, seq: ActiveSeq, ladder_nd: int, fused: bool) -> None:
    verify_and_settle(model, [seq], [[seq.last_token]], ladder_nd, "bootstrap", fused)


# -- prompt-lookup copies ------------------------------------------------------------------


def find_copy(history: list[int], max_len: int) -> list[int]:
    for n in NGRAM_SIZES:
        if len(history) <= n:
            continue
        key = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start : start + n] == key:
                return history[start + n : start + n + max_len]
    return []


def offer_copy(a: ActiveSeq, capacity: int) -> bool:
    """Give the sequence a copy as its drafts for this step, when its history repeats."""
    most = min(MAX_COPY, capacity, a.remaining - 1)
    # Copies are point masses, which the service's residuals do not model: greedy only.
    if most < 1 or a.grammar is not None or a.samples:
        return False
    copy = find_copy([*a.req.prompt_ids, *a.generated], most)
    if not copy:
        return False
    a.pending_drafts, a.pending_conf, a.copy = copy, [1.0] * len(copy), len(copy)
    return True


def _copies(active: list[ActiveSeq], ctx: StepContext, idxs: list[int]) -> None:
    if not idxs:
        return
    with span(TRACER, "prompt_lookup", **{"met.sequences": len(idxs)}) as sp:
        found = sum(offer_copy(active[i], ctx.capacity(active[i].slot)) for i in idxs)
        sp.set_attribute("met.copies", found)


# -- batched verify ------------------------------------------------------------------------


def _partition(
    active: list[ActiveSeq], verify: list[int], ctx: StepContext, ladder_nd: int
) -> tuple[list[int], list[int], list[int]]:
    """(serial, batchable, copies): a batch needs two sequences with drafts, `--mtp-max-seqs`
    > 1 and the lever on; a copy joins it at its own depth; any other sequence batches with
    at most `ladder_nd` drafts, more being cut.

    A sequence holding fewer than `ladder_nd` joins the batch at its own depth, never
    alone: every sequence holds fewer the step after the width grows (its drafts were made
    at the old width), and so does one near its token budget; verified one at a time, they
    would turn whole steps serial."""
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


def _verify_batched(
    model: ServingModel,
    active: list[ActiveSeq],
    batchable: list[int],
    copies: list[int],
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
        rows = [
            [a.last_token, *a.pending_drafts[: k - 1]] for a, k in zip(seqs, seq_ks, strict=True)
        ]
        verify_and_settle(model, seqs, rows, ladder_nd, "batched", o.fused_step)
    return serial


def chunk_ranges(ks: list[int], max_rows: int, max_batch: int) -> list[tuple[int, int]]:
    out, lo, rows = [], 0, 0
    for i, k in enumerate(ks):
        if i > lo and (rows + k > max_rows or i - lo >= max_batch):
            out.append((lo, i))
            lo, rows = i, 0
        rows += k
    if lo < len(ks):
        out.append((lo, len(ks)))
    return out


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


# -- the DFlash arm ------------------------------------------------------------------------


def _step_dflash(
    model: ServingModel, active: list[ActiveSeq], ctx: StepContext, num_drafts: int
) -> StepReport:
    """Gamma from the resolver (it shadows the serve-wide count), clamped; the bootstrap;
    then the DFlash verify, batched where the group and the budget allow."""
    gamma = ctx.dflash_rung.drafts_for(len(active), num_drafts)
    width = clamp_drafts_to_slot_capacity(gamma, (ctx.capacity(a.slot) for a in active))
    report = StepReport(ladder_nd=width, copied=[False] * len(active))
    boot, verify = split(active)
    if boot:
        report.bootstrap = bootstrap(model, [active[i] for i in boot], ctx, width)
    opts = ctx.opts
    serial: list[int] = []
    if len(verify) >= 2 and opts.dflash_batch_verify and opts.batch_verify:
        batchable, serial, gamma = plan_batch(active, verify)
        m_max = widest_chunk(ctx.caps, gamma, len(batchable))
        if len(batchable) >= 2 and m_max >= 2:
            by_slot = sorted(batchable, key=lambda i: (active[i].slot, i))
            for lo in range(0, len(by_slot), m_max):
                chunk = by_slot[lo : lo + m_max]
                if len(chunk) < 2:
                    serial.extend(chunk)
                    continue
                report.batched_calls.append([gamma + 1] * len(chunk))
                rows = [[active[i].last_token, *active[i].pending_drafts] for i in chunk]
                seqs = [active[i] for i in chunk]
                verify_and_settle(model, seqs, rows, width, "dflash-batched", opts.fused_step)
        else:
            report.dflash_declined = bool(batchable)
            serial.extend(batchable)
    else:
        serial = list(verify)
    for i in serial:
        _dflash_serial(model, active[i], width, opts.fused_step, report)
    return report


def plan_batch(active: list[ActiveSeq], verify: list[int]) -> tuple[list[int], list[int], int]:
    """(batchable, serial, gamma): the sequences without a grammar whose draft count equals
    the first such sequence's."""
    batchable, serial, gamma = [], [], 0
    for i in verify:
        a = active[i]
        g = len(a.pending_drafts)
        if a.grammar is not None or g < 1:
            serial.append(i)
        elif gamma in (0, g):
            gamma = g
            batchable.append(i)
        else:
            serial.append(i)
    return batchable, serial, gamma


def widest_chunk(caps: Capabilities, gamma: int, count: int) -> int:
    """`m_max`: the widest group of `gamma + 1`-row verifies the service accepts."""
    m_max = count
    while m_max >= 2 and not fits_batch(caps, [gamma + 1] * m_max):
        m_max -= 1
    return m_max


def _dflash_serial(
    model: ServingModel, a: ActiveSeq, num_drafts: int, fused: bool, report: StepReport
) -> None:
    """One sequence's drafts, cut before the first one its grammar rejects."""
    drafts = a.pending_drafts
    if a.grammar is not None:
        kept = a.grammar.valid_prefix(drafts)
        if kept < len(drafts):
            a.stats.grammar_truncations += 1
        drafts = drafts[:kept]
    a.pending_drafts, a.pending_conf = drafts, a.pending_conf[: len(drafts)]
    if not drafts:
        return
    report.serial_arms.append("DFlash")
    verify_and_settle(model, [a], [[a.last_token, *drafts]], num_drafts, "dflash-serial", fused)
