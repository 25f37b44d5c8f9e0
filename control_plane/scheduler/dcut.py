"""D-Cut: each batched sequence's verify depth from its draft confidences.

A sequence keeps its drafts while the running product of their confidences (the drafter's
probability that the chain so far is right) stays at or above `threshold`, and keeps at least
one; its k is that count + 1. The batch is then put in dispatch order, deepest first, then
slot (not the canonical slot order: its depths now differ). D-Cut stands aside, every k being
`ladder_nd + 1`, when the `dcut` lever is off, when `ladder_nd < 2` (nothing to cut), or
when the batch is wider than `width_cap` (wide batches are cheap per row; cutting saves
little and costs the canonical order).
"""

from __future__ import annotations

from control_plane.scheduler.seq import ActiveSeq


def depth(confidences: list[float], threshold: float) -> int:
    keep, chain = 0, 1.0
    for c in confidences:
        chain *= c
        if chain < threshold:
            break
        keep += 1
    return max(keep, 1)


def plan(
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
        keep = depth(a.pending_conf[:ladder_nd], threshold)
        del a.pending_drafts[keep:]
        del a.pending_conf[keep:]
    batchable.sort(key=lambda i: (-len(active[i].pending_drafts), active[i].slot, i))
    return [len(active[i].pending_drafts) + 1 for i in batchable], True
