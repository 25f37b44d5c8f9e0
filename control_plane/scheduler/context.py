"""What one `step_mtp` needs besides the sequences: the options (its levers), the width
sources, the service's shape."""

from __future__ import annotations

from dataclasses import dataclass, field

from control_plane.scheduler.choice import Chooser
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.widths import (
    AdaptiveRung,
    Calibration,
    CostTable,
    DFlashRung,
    StepOverhead,
)
from protos.model import Capabilities


@dataclass(frozen=True)
class StepContext:
    opts: SchedulerOptions  # environment switches already applied
    caps: Capabilities
    rung: AdaptiveRung  # the static ladder, raised by acceptance
    # --spec-cost-model measured: the table, the acceptance it is weighed with, and what
    # served steps cost beyond it.
    costs: CostTable | None = None
    calibration: Calibration = field(default_factory=Calibration)
    overhead: StepOverhead = field(default_factory=StepOverhead)
    dflash_rung: DFlashRung = field(default_factory=DFlashRung)
    replica: str = "local"  # the GPU service it steps, as its spans name it
    chooser: Chooser = field(default_factory=Chooser)  # the server's choice of method (auto)

    @classmethod
    def build(
        cls,
        caps: Capabilities,
        opts: SchedulerOptions | None = None,
        costs: CostTable | None = None,
        replica: str = "local",
    ) -> StepContext:
        opts = opts or SchedulerOptions()
        rung = AdaptiveRung(opts.ladder, enabled=opts.adaptive_rung)
        dflash = DFlashRung(opts.dflash_pinned)
        return cls(opts, caps, rung, costs, dflash_rung=dflash, replica=replica)

    def capacity(self, slot: int) -> int:
        return self.caps.slot_verify_drafts[slot]
