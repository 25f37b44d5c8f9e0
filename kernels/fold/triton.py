"""The fold as one gather: for every layer and slot, copy the picked verify row's state into
the live state."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _gather_rows(src_ptr, dst_ptr, src_idx_ptr, dst_idx_ptr, row_size, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    src = tl.load(src_idx_ptr + i).to(tl.int64) * row_size
    dst = tl.load(dst_idx_ptr + i).to(tl.int64) * row_size
    for o0 in range(0, row_size, BLOCK):
        o = o0 + tl.arange(0, BLOCK)
        m = o < row_size
        tl.store(dst_ptr + dst + o, tl.load(src_ptr + src + o, mask=m), mask=m)


def fold(
    live: torch.Tensor,
    rows: torch.Tensor,
    slots: list[int] | torch.Tensor,
    picks: list[int] | torch.Tensor,
) -> None:
    """live: [L, slots, ...], rows: [L, pool, ...]; live[:, slots[i]] = rows[:, picks[i]].
    slots, picks: lists, or int64 tensors on the device (no host round trip)."""
    if live.dtype != rows.dtype or live.shape[2:] != rows.shape[2:]:
        raise ValueError("fold: live state and verify rows differ in dtype or row shape")
    if not (live.is_contiguous() and rows.is_contiguous()):
        raise ValueError("fold: live state and verify rows must be contiguous")
    layers, n_slots, pool = live.shape[0], live.shape[1], rows.shape[1]
    row_size = live[0, 0].numel()
    if len(picks) == 0:
        return
    picks_t = torch.as_tensor(picks, dtype=torch.int64, device=live.device)
    slots_t = torch.as_tensor(slots, dtype=torch.int64, device=live.device)
    layer = torch.arange(layers, device=live.device)[:, None]
    src = (layer * pool + picks_t).reshape(-1)
    dst = (layer * n_slots + slots_t).reshape(-1)
    _gather_rows[(src.numel(),)](rows, live, src, dst, row_size, BLOCK=BLOCK)
