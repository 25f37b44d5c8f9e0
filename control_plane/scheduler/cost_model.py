"""The measured cost model (`--spec-cost-model measured`): the step's draft depth from the
service's measured verify and propose costs and the observed acceptance.

For `n` active sequences and depth `d`, a step costs `verify(n, d) + propose(n, d)`
(measured, the drafted depths smoothed onto a line; a width between two measured ones takes
the next larger, past the largest it scales linearly) and gains
`n * (1 + a_1 + a_1 a_2 + ... + a_1..a_d)` tokens, `a_j` the acceptance at
draft position j, observed over a window of verifies. Until a position has 32 observations it
takes the deepest shallower position's rate, else 0.7 (about a trained MTP head's first-draft
acceptance, so that a cold start drafts rather than waiting to learn that it should).
Each depth's cost also carries what a served step costs beyond the table (`StepOverhead`).
`propose_depth` picks the depth with the most tokens per millisecond, then the shallowest
depth within `slack` of it (a cheaper step at nearly the same rate). Above `--mtp-max-seqs` it
returns 0 and the step plain-decodes; within the cap the caller floors a 0 to 1;
`--num-drafts 0` turns drafting off.

A deliberate departure from the Rust engine, which maximises tokens per joule: this one
maximises tokens per millisecond. The service measures time (`measure_costs`), and no
portable energy counter exists on the CPUs and GPUs it runs on; at a fixed power draw the
two orders agree, and latency is what a client of this server waits on.
"""

from __future__ import annotations

import statistics
from collections import deque

from control_plane.scheduler.options import SchedulerOptions
from protos.model import Capabilities, CostEntry, ServingModel

PRIOR, MIN_SEEN, WINDOW = 0.7, 32, 512
OVERHEAD_WINDOW = 64


def cost_widths(limit: int) -> list[int]:
    """The batch widths a cost table is measured at, up to `limit` sequences; a width
    between two of them reads the next larger (`CostTable.step_ms`)."""
    return [w for w in (1, 2, 4, 8, 16, 32) if w <= limit]


class Calibration:
    """Acceptance by draft position over the last WINDOW verifies that reached it."""

    def __init__(self) -> None:
        self.by_position: list[deque[bool]] = []

    def observe(self, drafted: int, accepted: int) -> None:
        while len(self.by_position) < drafted:
            self.by_position.append(deque(maxlen=WINDOW))
        for j in range(drafted):
            self.by_position[j].append(j < accepted)
            if j >= accepted:
                break  # positions past the first rejection were not judged

    def rate(self, position: int) -> float:
        """A position seen too little to judge takes the rate of the deepest shallower one
        that was (PRIOR if none was): a draft that follows a run of accepted ones stands at
        least about as often, so the model tries a depth it has not drafted yet, and then
        sees it, rather than never drafting past the deepest depth it was started at."""
        for j in range(min(position, len(self.by_position) - 1), -1, -1):
            seen = self.by_position[j]
            if len(seen) >= MIN_SEEN:
                return sum(seen) / len(seen)
        return PRIOR


class StepOverhead:
    """What a served step costs beyond the table: the median, over the last OVERHEAD_WINDOW
    steps, of each step's time as the scheduler saw it less the table's cost at its width and
    depth, floored at 0; 0 until a step is seen. The table times the engine alone on short
    scratch sequences. A served step also pays the scheduler, the transport and its
    sequences' longer context, about alike at every depth: left out, it makes every step look
    cheaper than it is, and a deeper step's extra cost weigh more than it does."""

    def __init__(self) -> None:
        self.seen: deque[float] = deque(maxlen=OVERHEAD_WINDOW)

    def observe(self, table: CostTable | None, n: int, depth: int, served_ms: float) -> None:
        ms = table.step_ms(n, depth) if table is not None else None
        if ms is not None:
            self.seen.append(served_ms - ms)

    @property
    def ms(self) -> float:
        return max(0.0, statistics.median(self.seen)) if self.seen else 0.0


class CostTable:
    """Step costs by (width, depth): depth 0 as measured, the drafted depths of each width on
    their least-squares line (`drafted_line`)."""

    def __init__(self, entries: list[CostEntry]) -> None:
        measured = {(e.width, e.depth): e.verify_ms + e.propose_ms for e in entries}
        self.widths = sorted({e.width for e in entries})
        self.cost = dict(measured)
        for w in self.widths:
            drafted = {d: ms for (ww, d), ms in measured.items() if ww == w and d > 0}
            self.cost.update({(w, d): ms for d, ms in drafted_line(drafted).items()})

    def step_ms(self, n: int, depth: int) -> float | None:
        larger = [w for w in self.widths if w >= n]
        w = larger[0] if larger else self.widths[-1]
        ms = self.cost.get((w, depth))
        if ms is None:
            return None
        return ms if larger else ms * n / w


def drafted_line(costs: dict[int, float]) -> dict[int, float]:
    """Drafted depths' step costs (depth -> ms) on their least-squares line, its slope floored
    at zero; fewer than three depths stay as measured. A drafted step is the drafter's fixed
    work plus, per draft, one MTP pass and one more verified row: linear in the depth. Each
    measured cell carries a few percent of noise, enough to rank depth 2 over depth 3 where
    their rates lie that close; the line ranks them by what every cell measured. Depth 0
    runs no drafter, so it is not on the line."""
    if len(costs) < 3:
        return dict(costs)
    n = len(costs)
    mean_d, mean_ms = sum(costs) / n, sum(costs.values()) / n
    spread = sum((d - mean_d) ** 2 for d in costs)
    slope = max(0.0, sum((d - mean_d) * (ms - mean_ms) for d, ms in costs.items()) / spread)
    return {d: mean_ms + slope * (d - mean_d) for d in costs}


def propose_depth(
    table: CostTable,
    calibration: Calibration,
    n: int,
    slack: float,
    mtp_max_seqs: int,
    max_depth: int,
    overhead_ms: float = 0.0,
) -> int:
    if n > mtp_max_seqs or max_depth < 1:
        return 0
    rates: dict[int, float] = {}
    chain, tokens = 1.0, 1.0
    for d in range(max_depth + 1):
        if d:
            chain *= calibration.rate(d - 1)
            tokens += chain
        ms = table.step_ms(n, d)
        if ms is not None and ms > 0:
            rates[d] = n * tokens / (ms + overhead_ms)
    if not rates:
        return 0
    best = max(rates.values())
    return min(d for d, r in rates.items() if r >= best * (1 - slack))


def measured_table(
    model: ServingModel, caps: Capabilities, opts: SchedulerOptions
) -> CostTable | None:
    """The measured cost model's table, once per connection: under `measured`, measured by
    the service if it has none; under `auto`, the one it has, else None (the ladder), which
    asks no admin key and no engine time; None under `static`."""
    if opts.spec_cost_model == "static":
        return None
    widths = cost_widths(caps.num_slots)
    depth = min(opts.num_drafts, max(caps.slot_verify_drafts))
    auto = opts.spec_cost_model == "auto"
    entries, _ = model.measure_costs(widths, depth, cached_only=auto)
    return CostTable(entries) if entries else None
