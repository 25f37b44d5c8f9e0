"""`met bench`'s figures at one request: a draft's measured cost against a target step, and
the mtp / none speedup that the accepted length predicts from them, against the measured one.

From `Engine.measure_costs` at width 1 (gpu_service/engine/costs.py), per depth j (drafts verified):
`verify_ms(j)` is a verify of j + 1 rows of one sequence; `propose_ms(j)` its verdict: fold
and commit, and for j > 0 also the stash, j chained MTP drafts and the trim (at j = 0 no
drafter runs).

- The target step is a plain decode step of one sequence: `verify_ms(0) + propose_ms(0)`,
  one row's forward, then its fold and commit.
- A draft's cost `draft_ms` is the least-squares slope, through depth 0, of
  `propose_ms(j) - propose_ms(0)` over j = 1..D: the drafter's fixed work (stash, trim) runs
  only when a step drafts, so it is charged to the drafts rather than left in the intercept
  of a free fit, which would also need two drafted depths where this needs one.
- An mtp step of d drafts costs `verify_ms(d) + propose_ms(0) + d * draft_ms`: the verdict's
  fold and commit are in it as in the target step; d is the mean drafts per verify from the
  spec stats (fractional: `verify_ms` is interpolated between the measured depths), else the
  configured depth. It yields L tokens, the mean accepted length per verify, bonus included,
  so mtp / none is predicted as `L * target step / mtp step`.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import asdict
from typing import TYPE_CHECKING
from unittest import mock

from control_plane.scheduler.options import SchedulerOptions
from protos.model import CostEntry
from protos.params import MTP, NONE

if TYPE_CHECKING:
    from gpu_service.engine.facade import Engine


def by_depth(entries: list[CostEntry]) -> dict[int, CostEntry]:
    """The width-1 entries by depth."""
    return {e.depth: e for e in entries if e.width == 1}


def target_step_ms(entries: list[CostEntry]) -> float:
    """A plain decode step of one sequence: one row's verify and its verdict."""
    plain = by_depth(entries)[0]
    return plain.verify_ms + plain.propose_ms


def draft_ms(entries: list[CostEntry]) -> float:
    """One MTP draft's cost at width 1: the least-squares slope through depth 0 of the
    verdict's growth over the plain verdict."""
    at = by_depth(entries)
    deep = [j for j in at if j > 0]
    if not deep:
        raise ValueError("a draft's cost needs the costs measured at a depth of 1 or more")
    grown = sum(j * (at[j].propose_ms - at[0].propose_ms) for j in deep)
    return grown / sum(j * j for j in deep)


def verify_at(entries: list[CostEntry], drafts: float) -> float:
    """`verify_ms` at width 1 and `drafts` drafts (fractional), linear between the measured
    depths either side; outside the measured depths, the nearest one's."""
    at = by_depth(entries)
    d = min(max(drafts, min(at)), max(at))
    lo, hi = max(j for j in at if j <= d), min(j for j in at if j >= d)
    if lo == hi:
        return at[lo].verify_ms
    f = (d - lo) / (hi - lo)
    return at[lo].verify_ms * (1 - f) + at[hi].verify_ms * f


def mtp_step_ms(entries: list[CostEntry], drafts: float, draft: float) -> float:
    """One sequence's mtp step of `drafts` drafts, each costing `draft` ms."""
    return verify_at(entries, drafts) + by_depth(entries)[0].propose_ms + drafts * draft


def predicted_speedup(accepted_length: float, step_ms: float, mtp_ms: float) -> float:
    """mtp / none: `accepted_length` tokens per mtp step of `mtp_ms` against one per
    `step_ms`."""
    return accepted_length * step_ms / mtp_ms


def deviation(predicted: float, measured: float) -> float:
    """How far the prediction lies from the measurement, as a fraction of the measurement."""
    return predicted / measured - 1


def configured_depth(engine: Engine) -> int:
    """The drafts a step verifies at most under the bench's scheduler options."""
    return min(SchedulerOptions().num_drafts, max(engine.svc.slot_verify_drafts))


def draft_cost(engine: Engine, depth: int, repeats: int) -> dict:
    """Measures the costs at width 1 and depths 0..`depth` afresh, in a cache directory of
    its own so that neither this run's cost model nor the user's cached or shipped tables see
    this width-1 table: `cost_figures` with the depth and repeats."""
    with (
        tempfile.TemporaryDirectory() as cache,
        mock.patch.dict(os.environ, {"XDG_CACHE_HOME": cache}),
    ):
        entries, _ = engine.measure_costs([1], depth, repeats, refresh=True)
    return {"max_depth": depth, "repeats": repeats, **cost_figures(entries)}


def cost_figures(entries: list[CostEntry]) -> dict:
    """The width-1 entries, the target step, a draft's cost and their ratio."""
    step, draft = target_step_ms(entries), draft_ms(entries)
    return {
        "width": 1,
        "entries": [asdict(e) for e in by_depth(entries).values()],
        "target_step_ms": step,
        "verdict_ms": by_depth(entries)[0].propose_ms,
        "draft_ms": draft,
        "draft_over_step": draft / step,
    }


def prediction(rows: list[dict], cost: dict, speedup_rows: list[dict]) -> dict:
    """mtp / none at one request predicted from the methods section's mtp row and `cost`
    (`draft_cost`), against the measured ratio: in process (the methods section's) and over
    gRPC (the split's, pipelined) where measured."""
    one = {r["method"]: r for r in rows if r["concurrency"] == 1}
    mtp, none = one[MTP], one[NONE]
    drafts, source = mtp["drafts_per_verify"], "spec stats"
    if drafts is None:
        drafts, source = cost["max_depth"], "configured"
    entries = [CostEntry(**e) for e in cost["entries"]]
    step = mtp_step_ms(entries, drafts, cost["draft_ms"])
    predicted = predicted_speedup(mtp["accepted_length"], cost["target_step_ms"], step)
    out = {
        "accepted_length": mtp["accepted_length"],
        "drafts_per_verify": drafts,
        "drafts_from": source,
        "mtp_step_ms": step,
        "predicted": predicted,
        "measured_in_process": mtp["tok_s"] / none["tok_s"],
    }
    out["deviation_in_process"] = deviation(predicted, out["measured_in_process"])
    grpc = [r["grpc"] for r in speedup_rows if r["concurrency"] == 1]
    if grpc:
        out["measured_grpc"] = grpc[0]
        out["deviation_grpc"] = deviation(predicted, grpc[0])
    return out
