"""The step's width sources: how many drafts a step proposes, by the number of active
sequences, and how deep each batched sequence verifies them. Each rung answers
`drafts_for(active, num_drafts)` (`Rung`); `arms.step_width` picks the source for a step.

The K ladder (`--k-ladder`, `Ladder`) `4:3,8:3,16:1,32:1` reads: up to 4 active sequences
draft 3, up to 8 draft 3, up to 16 draft 1, up to 32 draft 1. Above the last rung the last
rung's width applies (so the ladder alone never turns drafting off: `--num-drafts 0` does, and
the step plain-decodes above `--mtp-max-seqs`). The width is clamped to `[1, num_drafts]`,
and is 0 when `num_drafts` is 0; then to the smallest verify-slot capacity
(`clamp_drafts_to_slot_capacity`).

The adaptive rung (`AdaptiveRung`): with 9..16 active sequences the static ladder drafts 1,
while the default tiers give slots 8-15 space for 2. When the drafter's first draft has lately
been accepted often, the rung raises those steps to 2 drafts. A window of the last `window`
(64) verifies that carried drafts records whether each one's first draft stood. With the window
full, the rung rises when first-draft acceptance is at least `raise_at` (0.6) and falls when it
drops below `lower_at` (0.4); in between it holds, so it does not flap. Outside 9..16 active
sequences the ladder's width stands. Off with the `adaptive_rung` option
(`--no-adaptive-rung`, `METRALE_NO_MTP_ADAPTIVE_RUNG`). Above `--mtp-max-seqs` the step
plain-decodes whatever the rung says.

The DFlash gamma resolver (`DFlashRung`): by the number of active sequences (bootstrapping ones
count), `GAMMA_LADDER` `4:8,8:6,16:4,32:3` (past the last rung the last holds), never above the
serve-wide count. Pinned, it returns the serve-wide count unchanged: by `--dflash-gamma` or
`--dflash-static-gamma` (`METRALE_DFLASH_STATIC_GAMMA`), or when that count is below 3
(nothing to resolve). It is not capped by `--mtp-max-seqs`.

The measured cost model (`--spec-cost-model measured`): the step's draft depth from the
service's measured verify and propose costs and the observed acceptance. For `n` active
sequences and depth `d`, a step costs `verify(n, d) + propose(n, d)` (measured, the drafted
depths smoothed onto a line; a width between two measured ones takes the next larger, past the
largest it scales linearly) and gains `n * (1 + a_1 + a_1 a_2 + ... + a_1..a_d)` tokens, `a_j`
the acceptance at draft position j, observed over a window of verifies. Until a position has
32 observations it takes the deepest shallower position's rate, else 0.7 (about a trained MTP
head's first-draft acceptance, so that a cold start drafts rather than waiting to learn that it
should). Each depth's cost also carries what a served step costs beyond the table
(`StepOverhead`). `propose_depth` picks the depth with the most tokens per millisecond, then
the shallowest depth within `slack` of it (a cheaper step at nearly the same rate). Above
`--mtp-max-seqs` it returns 0 and the step plain-decodes; within the cap the caller floors a 0
to 1; `--num-drafts 0` turns drafting off. Tokens per millisecond, not per joule: the service
measures time (`measure_costs`), no portable energy counter exists on the CPUs and GPUs it runs
on, at a fixed power draw the two orders agree, and latency is what a client waits on.

D-Cut (`dcut_plan`): each batched sequence's verify depth from its draft confidences. A
sequence keeps its drafts while the running product of their confidences (the drafter's
probability that the chain so far is right) stays at or above `threshold`, and keeps at least
one; its k is that count + 1. The batch is then put in dispatch order, deepest first, then slot
(not the canonical slot order: its depths now differ). D-Cut stands aside, every k being
`ladder_nd + 1`, when the `dcut` lever is off, when `ladder_nd < 2` (nothing to cut), or when
the batch is wider than `width_cap` (wide batches are cheap per row; cutting saves little and
costs the canonical order).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from control_plane.scheduler.seq import ActiveSeq
from protos import checks
from protos.model import Capabilities, CostEntry, ServingModel

LOW, HIGH = 9, 16  # the adaptive rung's span of active sequences


class Rung(Protocol):
    """A width source: the drafts a step of `active` sequences proposes, at most
    `num_drafts`."""

    def drafts_for(self, active: int, num_drafts: int) -> int: ...


# -- the K ladder -------------------------------------------------------------------------


@dataclass(frozen=True)
class Ladder:
    rungs: tuple[tuple[int, int], ...]  # (up to this many active sequences, drafts), ascending
    enabled: bool = True

    @classmethod
    def parse(cls, spec: str, enabled: bool = True) -> Ladder:
        rungs = tuple(checks.parse_pairs(spec, "K ladder rung", "ACTIVE", "DRAFTS"))
        if [n for n, _ in rungs] != sorted({n for n, _ in rungs}):
            raise ValueError(f"K ladder {spec!r}: rungs must be in ascending order of ACTIVE")
        return cls(rungs, enabled)

    def drafts_for(self, active: int, num_drafts: int) -> int:
        if num_drafts <= 0:
            return 0
        if not self.enabled:
            return num_drafts
        width = next((d for n, d in self.rungs if active <= n), self.rungs[-1][1])
        return min(max(width, 1), num_drafts)


def clamp_drafts_to_slot_capacity(drafts: int, capacities: Iterable[int]) -> int:
    """No sequence gets more drafts than its verify slot holds."""
    return min([drafts, *capacities])


# -- the adaptive rung --------------------------------------------------------------------


class AdaptiveRung:
    def __init__(
        self,
        ladder: Ladder,
        enabled: bool = True,
        window: int = 64,
        raise_at: float = 0.6,
        lower_at: float = 0.4,
    ) -> None:
        self.ladder, self.enabled = ladder, enabled
        self.window: deque[bool] = deque(maxlen=window)
        self.raise_at, self.lower_at = raise_at, lower_at
        self.raised = False

    def observe(self, drafted: int, accepted: int) -> None:
        """One verify of one sequence."""
        if drafted == 0:
            return
        self.window.append(accepted > 0)
        if len(self.window) < (self.window.maxlen or 0):
            return
        rate = sum(self.window) / len(self.window)
        if rate >= self.raise_at:
            self.raised = True
        elif rate < self.lower_at:
            self.raised = False

    def drafts_for(self, active: int, num_drafts: int) -> int:
        width = self.ladder.drafts_for(active, num_drafts)
        if self.enabled and self.raised and LOW <= active <= HIGH and width >= 1:
            return min(max(width, 2), num_drafts)
        return width


# -- the DFlash gamma resolver ------------------------------------------------------------


GAMMA_LADDER = "4:8,8:6,16:4,32:3"


class DFlashRung:
    def __init__(self, pinned: bool = False, ladder: str = GAMMA_LADDER) -> None:
        self.pinned, self.ladder = pinned, Ladder.parse(ladder)

    def drafts_for(self, active: int, num_drafts: int) -> int:
        if self.pinned or num_drafts < 3:
            return num_drafts
        return self.ladder.drafts_for(active, num_drafts)


# -- the measured cost model --------------------------------------------------------------


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
    model: ServingModel, caps: Capabilities, mode: str, num_drafts: int
) -> CostTable | None:
    """The measured cost model's table (`--spec-cost-model MODE`), once per connection:
    under `measured`, measured by the service if it has none; under `auto`, the one it has,
    else None (the ladder), which asks no admin key and no engine time; None under
    `static`."""
    if mode == "static":
        return None
    widths = cost_widths(caps.num_slots)
    depth = min(num_drafts, max(caps.slot_verify_drafts))
    entries, _ = model.measure_costs(widths, depth, cached_only=mode == "auto")
    return CostTable(entries) if entries else None


# -- D-Cut --------------------------------------------------------------------------------


def dcut_depth(confidences: list[float], threshold: float) -> int:
    keep, chain = 0, 1.0
    for c in confidences:
        chain *= c
        if chain < threshold:
            break
        keep += 1
    return max(keep, 1)


def dcut_plan(
    active: list[ActiveSeq],
    batchable: list[int],
    ladder_nd: int,
    enabled: bool,
    threshold: float,
    width_cap: int,
) -> tuple[list[int], bool]:
    """(ks, cut): each batchable sequence's k, in the order `batchable` is left in, and
    whether D-Cut planned them (then `batchable` is reordered and drafts truncated)."""
    depths = [min(len(active[i].pending_drafts), ladder_nd) for i in batchable]
    if not enabled or ladder_nd < 2 or len(batchable) > width_cap:
        return [d + 1 for d in depths], False
    for i in batchable:
        a = active[i]
        keep = dcut_depth(a.pending_conf[:ladder_nd], threshold)
        del a.pending_drafts[keep:]
        del a.pending_conf[keep:]
    batchable.sort(key=lambda i: (-len(active[i].pending_drafts), active[i].slot, i))
    return [len(active[i].pending_drafts) + 1 for i in batchable], True
