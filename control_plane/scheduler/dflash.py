"""The DFlash arm of `step_mtp` (planning only; the block drafter itself comes later): with a
DFlash drafter every sequence proposes `gamma` drafts at once and the verify keeps the raw
argmax.

Gamma resolver (`DFlashRung`): by the number of active sequences (bootstrapping ones count),
`GAMMA_LADDER` `4:8,8:6,16:4,32:3` (past the last rung the last holds), never above the
serve-wide count. Pinned, it returns the serve-wide count unchanged: by `--dflash-gamma` or
`--dflash-static-gamma` (`METRALE_DFLASH_STATIC_GAMMA`), or when that count is below 3
(nothing to resolve).

Batched verify: two or more sequences with drafts, the `dflash_batch_verify` and
`batch_verify` levers on. The batch is every sequence without a grammar whose draft count
equals the first such sequence's (gamma); the rest go serial. `m_max` is the widest group
the service's budget (`fits_batch`) takes at `gamma + 1` rows, shrinking from the whole
group; the group, in slot order, is verified in chunks of `m_max`; a trailing single goes
serial. A group the budget cannot take two of goes serial whole. The arm returns early (it
records its own step span).

The verify (and the propose after its verdict) runs at the clamped width: the resolver's gamma
clamped to the smallest verify-slot capacity, as the bootstrap's is. An unclamped gamma could
give a sequence more drafts than its slot can verify next step, a verify the service refuses,
so one width, clamped, serves the whole step.
"""

from __future__ import annotations

from control_plane.scheduler.ladder import Ladder
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.seq import ActiveSeq
from control_plane.scheduler.verdict import verify_and_settle
from protos.model import Capabilities, ServingModel, fits_batch

GAMMA_LADDER = "4:8,8:6,16:4,32:3"


class DFlashRung:
    def __init__(self, pinned: bool = False, ladder: str = GAMMA_LADDER) -> None:
        self.pinned, self.ladder = pinned, Ladder.parse(ladder)

    def drafts_for(self, active: int, num_drafts: int) -> int:
        if self.pinned or num_drafts < 3:
            return num_drafts
        return self.ladder.drafts_for(active, num_drafts)


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


def step_dflash(
    model: ServingModel,
    active: list[ActiveSeq],
    verify: list[int],
    num_drafts: int,
    opts: SchedulerOptions,
    caps: Capabilities,
    report,
) -> None:
    """The verify half of the DFlash arm (the bootstrap ran before it)."""
    serial: list[int] = []
    if len(verify) >= 2 and opts.dflash_batch_verify and opts.batch_verify:
        batchable, serial, gamma = plan_batch(active, verify)
        m_max = widest_chunk(caps, gamma, len(batchable))
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
                verify_and_settle(model, seqs, rows, num_drafts, "dflash-batched", opts.fused_step)
        else:
            report.dflash_declined = bool(batchable)
            serial.extend(batchable)
    else:
        serial = list(verify)
    for i in serial:
        _verify_serial(model, active[i], num_drafts, opts.fused_step, report)


def _verify_serial(model: ServingModel, a: ActiveSeq, num_drafts: int, fused: bool, report) -> None:
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
