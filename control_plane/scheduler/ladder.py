"""The step's draft width: the static K ladder, keyed on the number of active sequences, and
the clamp to the smallest verify-slot capacity.

The ladder (`--k-ladder`) `4:3,8:3,16:1,32:1` reads: up to 4 active sequences draft 3, up
to 8 draft 3, up to 16 draft 1, up to 32 draft 1. Above the last rung the last rung's width
applies (so the ladder alone never turns drafting off: `--num-drafts 0` does, and the step
plain-decodes above `--mtp-max-seqs`). The width is clamped to `[1, num_drafts]`, and is 0
when `num_drafts` is 0.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from protos import checks


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
