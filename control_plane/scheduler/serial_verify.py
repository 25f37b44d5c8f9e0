"""Serial verify: one call per sequence.

`serial_verify_plan(held, step_nd)`: keep `min(held, step_nd)` drafts (the drafter's chain
length this step), and verify them with `k = kept + 1` rows. The arm is named by its row
count, as the Rust engine's traces name it (so the two read alike): K2, K3, K4 for 1, 2, 3
drafts, KN for more. Every arm is the same verify with one sequence; the name is for stats
and traces."""

from __future__ import annotations

from control_plane.scheduler.seq import ActiveSeq
from control_plane.scheduler.verdict import verify_and_settle
from protos.model import ServingModel


def serial_verify_plan(held: int, step_nd: int) -> tuple[int, str]:
    keep = max(0, min(held, step_nd))
    return keep, {1: "K2", 2: "K3", 3: "K4"}.get(keep, "KN" if keep else "none")


def step_verify_serial(
    model: ServingModel, seq: ActiveSeq, drafts: list[int], step_nd: int, fused: bool
) -> None:
    verify_and_settle(model, [seq], [[seq.last_token, *drafts]], step_nd, "serial", fused)
