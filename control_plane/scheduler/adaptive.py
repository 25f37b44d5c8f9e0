"""The adaptive rung: with 9..16 active sequences the static ladder drafts 1, while the default
tiers give slots 8-15 room for 2. When the drafter's first draft has lately been accepted
often, the rung raises those steps to 2 drafts.

Rule: a window of the last `window` (64) verifies that carried drafts, each recording whether
its first draft stood. With the window full, the rung rises when first-draft acceptance is at
least `raise_at` (0.6) and falls when it drops below `lower_at` (0.4); in between it holds, so
it does not flap. Outside 9..16 active sequences the ladder's width stands. Off with the
`adaptive_rung` option (`--no-adaptive-rung`, `METRALE_NO_MTP_ADAPTIVE_RUNG`). Above
`--mtp-max-seqs` the step plain-decodes whatever the rung says (see `step_width`).
"""

from __future__ import annotations

from collections import deque

from control_plane.scheduler.ladder import Ladder

LOW, HIGH = 9, 16


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
