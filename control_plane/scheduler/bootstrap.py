"""Bootstrap: the sequences with no drafts pending take a one-token verify (k = 1), their
verdict, and their first drafts.

`can_batch_bootstrap`: batched when at least two sequences bootstrap, the `batch_bootstrap`
lever is on and one call of that many one-row sequences fits the service's budget
(`fits_batch`); otherwise each sequence bootstraps alone."""

from __future__ import annotations

from opentelemetry.util.types import AttributeValue

from control_plane.scheduler.context import StepContext
from control_plane.scheduler.seq import ActiveSeq
from control_plane.scheduler.verdict import verify_and_settle
from protos.model import ServingModel, fits_batch
from protos.telemetry import span, tracer

TRACER = tracer("met.control_plane")


def can_batch_bootstrap(model: ServingModel, ctx: StepContext, count: int) -> bool:
    return count >= 2 and ctx.opts.batch_bootstrap and fits_batch(ctx.caps, [1] * count)


def bootstrap(model: ServingModel, seqs: list[ActiveSeq], ctx: StepContext, ladder_nd: int) -> str:
    """Bootstrap `seqs`, proposing `ladder_nd` drafts each. -> "batched" or "serial"."""
    batched = can_batch_bootstrap(model, ctx, len(seqs))
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
