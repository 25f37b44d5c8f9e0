"""The block drafters' arm of `step_mtp`.

Sequences whose method drafts in blocks take it (`dflash` requests, and those the server's
choice gives a DFlash width this step), their drafts proposed by the service's DFlash drafter
(one block forward, named per call); with `--dflash` every speculative request
takes it, the MTP head's drafts planned as a block drafter's would be. Every sequence proposes
`gamma` drafts at once (the server's choice's width where it chose a block for any of them;
else `widths.DFlashRung`, at most the block's drafts for `dflash` requests, `--dflash-gamma`
when pinned) and the greedy verdict reads the service's processed logits
(penalties, bias and grammar masks applied), as every arm's does; no prompt lookup, no D-Cut
(its drafts come as one block, so there is no chain to copy into or to cut).
Batched verify: two or more sequences with drafts, the `dflash_batch_verify` and
`batch_verify` levers on. Every sequence's drafts are first cut before the first one its
grammar refuses. The batch is every sequence whose draft count equals the first unconstrained
such sequence's (gamma; a grammar that holds only after the output's reasoning does not
constrain while the model reasons); sequences of other counts (constrained ones, with their
rows' masks, or ones whose drafts another method made) verify together at their own depths
(chunked by `chunk_ranges`); a lone one goes serial. `m_max` is the widest group the
service's budget (`fits_batch`) takes at `gamma + 1` rows, shrinking from the whole group; the
group, in slot order, is verified in chunks of `m_max`; a trailing single goes serial. A group
the budget cannot take two of goes serial whole. The verify (and the propose after its
verdict) runs at the resolver's gamma clamped to the smallest verify-slot capacity, as the
bootstrap's is: an unclamped gamma could give a sequence more drafts than its slot can verify
next step, a verify the service refuses, so one width, clamped, serves the whole step.
"""

from __future__ import annotations

from control_plane.scheduler.bootstrap import (
    StepReport,
    bootstrap,
    bootstrap_serial,
    chunk_ranges,
    split,
)
from control_plane.scheduler.context import StepContext
from control_plane.scheduler.methods import BLOCKS
from control_plane.scheduler.seq import ActiveSeq
from control_plane.scheduler.verdict import verify_and_settle
from control_plane.scheduler.widths import clamp_drafts_to_slot_capacity
from protos.model import Capabilities, ServingModel, fits_batch


def step_dflash(
    model: ServingModel, active: list[ActiveSeq], ctx: StepContext, num_drafts: int
) -> StepReport:
    """Gamma from the resolver (it shadows the serve-wide count, or the block's drafts for
    `dflash` requests), clamped; the bootstrap; then the DFlash verify, batched where the
    group and the budget allow."""
    width = block_width(active, ctx, num_drafts)
    report = StepReport(ladder_nd=width, copied=[False] * len(active))
    boot, verify = split(active)
    if boot:
        report.bootstrap = bootstrap(model, [active[i] for i in boot], ctx, width)
    opts = ctx.opts
    serial: list[int] = []
    if len(verify) >= 2 and opts.dflash_batch_verify and opts.batch_verify:
        batchable, joiners, gamma = plan_batch(active, verify)
        serial = _verify_group(model, active, batchable, gamma, width, ctx, report)
        serial += _verify_ragged(model, active, joiners, width, ctx, report)
    else:
        serial = list(verify)
    for i in sorted(serial):
        _dflash_serial(model, active[i], width, opts.fused_step, report)
    return report


def block_width(active: list[ActiveSeq], ctx: StepContext, num_drafts: int) -> int:
    """A step's block drafts: the resolver's gamma for `active`, clamped to the smallest
    verify-slot capacity (the pipelined step's plans draft at it too)."""
    gamma = ctx.dflash_rung.drafts_for(len(active), most_drafts(active, ctx, num_drafts))
    return clamp_drafts_to_slot_capacity(gamma, (ctx.capacity(a.slot) for a in active))


def plan_batch(active: list[ActiveSeq], verify: list[int]) -> tuple[list[int], list[int], int]:
    """(batchable, joiners, gamma): every sequence's drafts cut where its grammar
    refuses one (or, not constraining yet, would); those whose draft count equals the first
    unconstrained such sequence's batch; the others (a constrained one, with its rows' masks;
    one whose drafts another method made the step before, under the server's choice) join the
    ragged batch at their own depths (`joiners`)."""
    batchable: list[int] = []
    joiners: list[int] = []
    gamma = 0
    for i in verify:
        a = active[i]
        a.cut_drafts()
        g = len(a.pending_drafts)
        if g >= 1 and (gamma == g or (gamma == 0 and not a.constrained)):
            gamma = g
            batchable.append(i)
        else:
            joiners.append(i)
    return batchable, joiners, gamma


def _verify_group(
    model: ServingModel,
    active: list[ActiveSeq],
    batchable: list[int],
    gamma: int,
    width: int,
    ctx: StepContext,
    report: StepReport,
) -> list[int]:
    """The equal-count group in slot order, in chunks of `m_max`. -> those left serial"""
    m_max = widest_chunk(ctx.caps, gamma, len(batchable))
    if len(batchable) < 2 or m_max < 2:
        report.dflash_declined = bool(batchable)
        return batchable
    serial = []
    by_slot = sorted(batchable, key=lambda i: (active[i].slot, i))
    for lo in range(0, len(by_slot), m_max):
        chunk = by_slot[lo : lo + m_max]
        if len(chunk) < 2:
            serial.extend(chunk)
            continue
        report.batched_calls.append([gamma + 1] * len(chunk))
        rows = [[active[i].last_token, *active[i].pending_drafts] for i in chunk]
        seqs = [active[i] for i in chunk]
        verify_and_settle(model, seqs, rows, width, "dflash-batched", ctx.opts.fused_step)
    return serial


def _verify_ragged(
    model: ServingModel,
    active: list[ActiveSeq],
    joiners: list[int],
    width: int,
    ctx: StepContext,
    report: StepReport,
) -> list[int]:
    """Constrained sequences of other counts, batched at their own depths in slot order, in
    chunks the budget takes. -> those left serial (a lone one)"""
    serial: list[int] = []
    by_slot = sorted(joiners, key=lambda i: (active[i].slot, i))
    ks = [len(active[i].pending_drafts) + 1 for i in by_slot]
    for lo, hi in chunk_ranges(ks, ctx.caps.max_rows, ctx.caps.max_batch):
        chunk = by_slot[lo:hi]
        if len(chunk) < 2:
            serial.extend(chunk)
            continue
        report.batched_calls.append(ks[lo:hi])
        rows = [[active[i].last_token, *active[i].pending_drafts] for i in chunk]
        seqs = [active[i] for i in chunk]
        verify_and_settle(model, seqs, rows, width, "dflash-ragged", ctx.opts.fused_step)
    return serial


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
        # The grammar took every draft: verify the last token alone, as a bootstrap does.
        report.serial_arms.append("K1")
        bootstrap_serial(model, a, num_drafts, fused)
        return
    report.serial_arms.append("DFlash")
    verify_and_settle(model, [a], [[a.last_token, *drafts]], num_drafts, "dflash-serial", fused)


def most_drafts(active: list[ActiveSeq], ctx: StepContext, num_drafts: int) -> int:
    """The resolver's ceiling: `--dflash-gamma` when given; for `dflash` requests a whole
    block's drafts; else (`--dflash` over MTP drafts) the serve-wide count."""
    if ctx.opts.dflash_gamma is not None:
        return ctx.opts.dflash_gamma
    if ctx.caps.dflash_block and all(a.method.arm == BLOCKS for a in active):
        return ctx.caps.dflash_block - 1
    return num_drafts
