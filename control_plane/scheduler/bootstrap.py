"""What every arm of `step_mtp` shares: the step's report, the split of a step's sequences
into bootstrap and verify, a batch's chunks, and the bootstrap.

Bootstrap: batched when at least two sequences bootstrap, the `batch_bootstrap` lever is on
and one call of that many one-row sequences fits the service's budget (`fits_batch`);
otherwise each sequence bootstraps alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from opentelemetry.util.types import AttributeValue

from control_plane.scheduler.context import StepContext
from control_plane.scheduler.seq import ActiveSeq
from control_plane.scheduler.verdict import verify_and_settle
from protos.model import ServingModel, fits_batch
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

    def merge(self, other: StepReport) -> None:
        """Another arm's report over other sequences of the same step."""
        self.ladder_nd = max(self.ladder_nd, other.ladder_nd)
        self.bootstrap = self.bootstrap or other.bootstrap
        self.batched_calls += other.batched_calls
        self.serial_arms += other.serial_arms
        self.dcut = self.dcut or other.dcut
        self.dflash_declined = self.dflash_declined or other.dflash_declined


def split(active: list[ActiveSeq]) -> tuple[list[int], list[int]]:
    """(bootstrap, verify) indices: no drafts pending, drafts pending."""
    boot = [i for i, a in enumerate(active) if not a.pending_drafts]
    verify = [i for i, a in enumerate(active) if a.pending_drafts]
    return boot, verify


def chunk_ranges(ks: list[int], max_rows: int, max_batch: int) -> list[tuple[int, int]]:
    """Consecutive ranges of a batch's sequences, each as long as the row budget (the sum
    of k) and the stash width (sequences per call) allow."""
    out, lo, rows = [], 0, 0
    for i, k in enumerate(ks):
        if i > lo and (rows + k > max_rows or i - lo >= max_batch):
            out.append((lo, i))
            lo, rows = i, 0
        rows += k
    if lo < len(ks):
        out.append((lo, len(ks)))
    return out


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
