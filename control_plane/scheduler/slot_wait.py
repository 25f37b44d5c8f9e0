"""The bound on waiting for a slot that nothing of this scheduler's will free: while it holds
no slot and the GPU service has none free (other sessions hold them all), a waiting request is
refused once it has waited `SchedulerOptions.slot_wait` so, not left to its deadline. A wait
behind this scheduler's own requests is not bounded: they end, and free their slots."""

from __future__ import annotations

from collections.abc import Iterable

from control_plane.scheduler.seq import ActiveSeq


class SlotWait:
    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self._since: float | None = None  # since when no slot is ours and none is free

    def overdue(
        self, waiting: Iterable[ActiveSeq], holding: bool, free_slots: int, now: float
    ) -> list[ActiveSeq]:
        """The waiting requests past the bound: each has waited it since it came or since
        the service was last seen with a slot for this scheduler, whichever is later."""
        if holding or free_slots > 0:
            self._since = None
            return []
        if self._since is None:
            self._since = now
        since = self._since
        return [a for a in waiting if now - max(a.submitted, since) >= self.limit_s]

    def sentence(self, num_slots: int) -> str:
        return (
            f"no slot of the GPU service came free in {self.limit_s:g} s: other sessions hold "
            f"all {num_slots} (the service's --max-slots-per-session bounds each one's share); "
            "retry later"
        )
