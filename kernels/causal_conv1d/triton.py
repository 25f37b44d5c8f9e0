"""Causal depthwise conv1d + SiLU over a varlen batch: sequence i owns rows
`cu[i] .. cu[i + 1] - 1` and reads its window from its slot. The update form also writes the
window after every row into the slot's verify rows; the prefill form writes the final window
back to the slot. One program per (sequence, channel block), walking its rows `ROWS` at a time."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHANNELS = 128
# Rows a program convolves at once: the interpreter pays per op, not per element; on sm_90 the
# flagship's launch takes 104-126 registers with [16, 128] tiles, no spills.
ROWS = 16


@triton.jit
def _seq(p_old, p_new, o_s, m, C, W: tl.constexpr):
    # Rows o_s of [window (W - 1 rows); x rows]; p_old / p_new point at the window's and x's
    # rows 0 and broadcast against o_s and m.
    m_old = o_s < W - 1
    o_off = o_s * C
    b_old = tl.load(p_old + o_off, mask=m & m_old, other=0.0)
    b_new = tl.load(p_new + o_off, mask=m & (o_s >= W - 1), other=0.0)
    return tl.where(m_old, b_old.to(b_new.dtype), b_new)


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
    WP: tl.constexpr,
    STORE_ROWS: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
):
    i = tl.program_id(0)
    o_t = tl.arange(0, BT)
    o_j = tl.arange(0, WP)
    o_c = tl.program_id(1) * BC + tl.arange(0, BC)
    m_c = (o_c < C)[None, :]
    lo = tl.load(cu_ptr + i)
    n = tl.load(cu_ptr + i + 1) - lo
    slot = tl.load(slot_ptr + i)
    # [1, BC] pointers: row s of [window; x] is p_old or p_new plus s rows; tap j (j >= 1) of
    # row t goes to p_rows plus (t * (W - 1) + j) rows, as row j - 1 of verify window t.
    p_old = win_ptr + slot * (W - 1) * C + o_c[None, :]
    p_new = x_ptr + (lo - (W - 1)) * C + o_c[None, :]
    p_out = out_ptr + lo * C + o_c[None, :]
    p_rows = rows_ptr + (tl.load(vrow_ptr + i) * (W - 1) - 1) * C + o_c[None, :]
    # [BC], loaded 1-D: as [1, BC] its strided layout would be imposed on the tiles.
    p_w = w_ptr + o_c * W
    m_w = o_c < C
    for t0 in range(0, n, BT):
        o_r = (t0 + o_t)[:, None]
        m = (o_r < n) & m_c
        # b_acc: [BT, BC], the taps summed in order as naive.py does
        b_acc = tl.zeros([BT, BC], tl.float32)
        for j in tl.static_range(W):
            # Tap j of rows o_r: rows o_r + j of [window; x].
            b_s = _seq(p_old, p_new, o_r + j, m, C, W)
            b_w = tl.load(p_w + j, mask=m_w, other=0.0).to(tl.float32)
            b_acc += b_s.to(tl.float32) * b_w[None, :]
            if STORE_ROWS and j > 0:
                # The window after row t holds its taps 1 .. W - 1.
                p_v = p_rows + (o_r * (W - 1) + j) * C
                tl.store(p_v, b_s.to(rows_ptr.dtype.element_ty), mask=m)
        b_y = b_acc * tl.sigmoid(b_acc)
        tl.store(p_out + o_r * C, b_y.to(out_ptr.dtype.element_ty), mask=m)
    if not STORE_ROWS:
        # b_last: [WP, BC], the final window is rows n .. n + W - 2 of [window; x]
        o_l = o_j[:, None]
        m_last = (o_l < W - 1) & m_c
        b_last = _seq(p_old, p_new, n + o_l, m_last, C, W)
        # A window row may be read by another thread than the one writing it: every read,
        # in the loop and here, lands before the write-back.
        tl.debug_barrier()
        tl.store(p_old + o_l * C, b_last.to(win_ptr.dtype.element_ty), mask=m_last)


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
        WP=triton.next_power_of_2(width),
        STORE_ROWS=False,
        BT=ROWS,
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
        WP=triton.next_power_of_2(width),
        STORE_ROWS=True,
        BT=ROWS,
        BC=CHANNELS,
    )
    return out
