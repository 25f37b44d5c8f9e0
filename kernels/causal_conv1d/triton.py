"""Causal depthwise conv1d + SiLU over a varlen batch: sequence i owns rows
`cu[i] .. cu[i + 1] - 1` and reads its window from its slot. The update form also writes the
window after every row into the slot's verify rows; the prefill form writes the final window
back to the slot. One program per (sequence, channel block)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHANNELS = 128


@triton.jit
def _tap(x_ptr, win_ptr, lo, slot, s, o_c, m_c, C, W: tl.constexpr):
    # Element s of [window (W - 1 rows), x rows]: from the window or from x.
    o_s = s + tl.zeros_like(o_c)
    b_w = tl.load(win_ptr + (slot * (W - 1) + o_s) * C + o_c, mask=m_c & (o_s < W - 1), other=0.0)
    b_x = tl.load(x_ptr + (lo + o_s - (W - 1)) * C + o_c, mask=m_c & (o_s >= W - 1), other=0.0)
    return b_w.to(tl.float32) + b_x.to(tl.float32)


@triton.jit
def _conv_kernel(
    x_ptr,
    win_ptr,
    w_ptr,
    out_ptr,
    rows_ptr,
    cu_ptr,
    slot_ptr,
    vrow_ptr,
    C,
    W: tl.constexpr,
    STORE_ROWS: tl.constexpr,
    BC: tl.constexpr,
):
    i = tl.program_id(0)
    o_c = tl.program_id(1) * BC + tl.arange(0, BC)
    m_c = o_c < C
    lo = tl.load(cu_ptr + i)
    n = tl.load(cu_ptr + i + 1) - lo
    slot = tl.load(slot_ptr + i)
    for t in range(0, n):
        b_acc = tl.zeros([BC], tl.float32)
        for j in tl.static_range(W):
            b_w = tl.load(w_ptr + o_c * W + j, mask=m_c, other=0.0).to(tl.float32)
            b_acc += _tap(x_ptr, win_ptr, lo, slot, t + j, o_c, m_c, C, W) * b_w
        b_y = b_acc * tl.sigmoid(b_acc)
        tl.store(out_ptr + (lo + t) * C + o_c, b_y.to(out_ptr.dtype.element_ty), mask=m_c)
        if STORE_ROWS:
            vrow = tl.load(vrow_ptr + i) + t
            for j in tl.static_range(W - 1):
                b_v = _tap(x_ptr, win_ptr, lo, slot, t + 1 + j, o_c, m_c, C, W)
                tl.store(
                    rows_ptr + (vrow * (W - 1) + j) * C + o_c,
                    b_v.to(rows_ptr.dtype.element_ty),
                    mask=m_c,
                )
    if not STORE_ROWS:
        # Reads reach indices n + j >= j, so each write lands behind every later read.
        for j in tl.static_range(W - 1):
            b_v = _tap(x_ptr, win_ptr, lo, slot, n + j, o_c, m_c, C, W)
            tl.store(
                win_ptr + (slot * (W - 1) + j) * C + o_c, b_v.to(win_ptr.dtype.element_ty), mask=m_c
            )


def _check(x: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor, cu: torch.Tensor) -> None:
    if x.dim() != 2 or windows.dim() != 3 or weight.dim() != 2:
        raise ValueError("causal_conv1d: x [T, C], windows [slots, W-1, C], weight [C, W]")
    if windows.shape[1] != weight.shape[1] - 1 or windows.shape[2] != x.shape[1]:
        raise ValueError(
            f"causal_conv1d: windows {tuple(windows.shape)} do not fit x "
            f"{tuple(x.shape)} and weight {tuple(weight.shape)}"
        )
    # The offsets' values are not read here: that would copy them to the host on every call.
    if cu.dim() != 1 or cu.dtype != torch.int32:
        raise ValueError(f"causal_conv1d: offsets must be a 1-D int32 tensor, got {cu.dtype}")


def causal_conv1d(
    x: torch.Tensor,
    windows: torch.Tensor,
    weight: torch.Tensor,
    cu: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """Prefill form. x: [T, C] (all sequences' rows), windows: [slots, W-1, C] (updated in
    place), weight: [C, W], cu: [n + 1], slots: [n] -> out [T, C]"""
    _check(x, windows, weight, cu)
    out = torch.empty_like(x)
    n, channels, width = len(slots), x.shape[1], weight.shape[1]
    _conv_kernel[(n, triton.cdiv(channels, CHANNELS))](
        x.contiguous(),
        windows,
        weight.contiguous(),
        out,
        windows,
        cu,
        slots,
        slots,
        channels,
        W=width,
        STORE_ROWS=False,
        BC=CHANNELS,
    )
    return out


def causal_conv1d_update(
    x: torch.Tensor,
    windows: torch.Tensor,
    weight: torch.Tensor,
    cu: torch.Tensor,
    slots: torch.Tensor,
    rows: torch.Tensor,
    vrows: torch.Tensor,
) -> torch.Tensor:
    """Verify form: the window after row t of sequence i goes to `rows[vrows[i] + t]`.
    rows: [pool, W-1, C] -> out [T, C]"""
    _check(x, windows, weight, cu)
    out = torch.empty_like(x)
    n, channels, width = len(slots), x.shape[1], weight.shape[1]
    _conv_kernel[(n, triton.cdiv(channels, CHANNELS))](
        x.contiguous(),
        windows,
        weight.contiguous(),
        out,
        rows,
        cu,
        slots,
        vrows,
        channels,
        W=width,
        STORE_ROWS=True,
        BC=CHANNELS,
    )
    return out
