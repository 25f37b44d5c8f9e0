"""Bootstrap: the sequences with no drafts pending take a one-token verify (k = 1), their
verdict, and their first drafts.

`can_batch_bootstrap`: batched when at least two sequences bootstrap, the lever is on
(`METRALE_NO_MTP_BATCH_BOOTSTRAP` unset) and the service accepts one call of that many
one-row sequences (`can_batch_verify`); otherwise each sequence bootstraps alone."""

from __future__ import annotations

from control_plane.scheduler.context import StepContext
from control_plane.scheduler.seq import ActiveSeq
from control_plane.scheduler.verdict import verify_and_settle
from protos.model import Model


def can_batch_bootstrap(model: Model, ctx: StepContext, count: int) -> bool:
    return count >= 2 and ctx.levers.batch_bootstrap and model.can_batch_verify([1] * count)


def bootstrap_batched(model: Model, seqs: list[ActiveSeq], ladder_nd: int) -> None:
    verify_and_settle(model, seqs, [[a.last] for a in seqs], ladder_nd, "bootstrap")


def bootstrap_serial(model: Model, seq: ActiveSeq, ladder_nd: int) -> None:
    verify_and_settle(model, [seq], [[seq.last]], ladder_nd, "bootstrap")
