"""Batched verify: which sequences batch, how the batch is cut into calls, and the order of
each call.

`chunk_ranges(ks, max_rows, max_batch)`: consecutive ranges, greedily as long as possible,
each within the row budget (sum of k) and the stash width (sequences per call).

`canonical_assignment(n, dcut)`: whether a batch of `n` uses the canonical order; it is
canonical whenever no depth planning reordered it (`dcut` false): a uniform batch, or one
whose ragged depths come from the drafts each sequence holds (made at an older width, or
near its token budget). A batch that D-Cut planned, or that copies joined at their own
depths, is not, and goes deepest first. It is asked with the width of the whole batch,
never a chunk's, so a chunked batch keeps the order its depths were planned under.

`verify_batch_permutation(slots, depths, canonical)`: canonical: ascending slot; otherwise
deepest first, then slot. The active index breaks ties, so the order is total."""

from __future__ import annotations

from control_plane.scheduler.seq import ActiveSeq
from control_plane.scheduler.verdict import verify_and_settle
from protos.model import ServingModel


def chunk_ranges(ks: list[int], max_rows: int, max_batch: int) -> list[tuple[int, int]]:
    out, lo, rows = [], 0, 0
    for i, k in enumerate(ks):
        if i > lo and (rows + k > max_rows or i - lo >= max_batch):
            out.append((lo, i))
            lo, rows = i, 0
        rows += k
    if lo < len(ks):
        out.append((lo, len(ks)))
    return out


def canonical_assignment(batch_n: int, dcut: bool = False) -> bool:
    return not dcut or batch_n < 2


def verify_batch_permutation(slots: list[int], depths: list[int], canonical: bool) -> list[int]:
    idx = range(len(slots))
    if canonical:
        return sorted(idx, key=lambda i: (slots[i], i))
    return sorted(idx, key=lambda i: (-depths[i], slots[i], i))


def step_verify_batched(
    model: ServingModel, seqs: list[ActiveSeq], ks: list[int], ladder_nd: int, fused: bool
) -> None:
    """One call: each sequence's rows `[last, drafts[:k-1]]`."""
    rows = [[a.last_token, *a.pending_drafts[: k - 1]] for a, k in zip(seqs, ks, strict=True)]
    verify_and_settle(model, seqs, rows, ladder_nd, "batched", fused)
