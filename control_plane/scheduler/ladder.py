"""The step's draft width: the static K ladder, keyed on the number of active sequences, and
the clamp to the smallest verify-slot capacity.

The ladder `4:3,8:3,16:1,32:1` reads: up to 4 active sequences draft 3, up to 8 draft 3, up
to 16 draft 1, up to 32 draft 1. Above the last rung the last rung's width applies (so the
ladder alone never turns drafting off; `--num-drafts 0` does). The width is clamped to
`[1, num_drafts]`, and is 0 when `num_drafts` is 0.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

DEFAULT_LADDER = "4:3,8:3,16:1,32:1"


@dataclass(frozen=True)
class Ladder:
    rungs: tuple[tuple[int, int], ...]  # (up to this many active sequences, drafts), ascending
    enabled: bool = True

    @classmethod
    def parse(cls, spec: str, enabled: bool = True) -> Ladder:
        rungs = []
        for part in spec.split(","):
            try:
                n, drafts = (int(x) for x in part.split(":"))
            except ValueError:
                raise ValueError(f"bad K ladder rung {part!r}; expected ACTIVE:DRAFTS") from None
            if n < 1 or drafts < 0:
                raise ValueError(f"bad K ladder rung {part!r}; ACTIVE >= 1 and DRAFTS >= 0")
            rungs.append((n, drafts))
        if [n for n, _ in rungs] != sorted({n for n, _ in rungs}):
            raise ValueError(f"K ladder {spec!r}: rungs must be in ascending order of ACTIVE")
        return cls(tuple(rungs), enabled)

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
