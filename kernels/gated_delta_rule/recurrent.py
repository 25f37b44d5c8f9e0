"""Gated delta rule, recurrent form, for verify and decode: a varlen batch where sequence i
owns rows `cu[i] .. cu[i + 1] - 1`, starts from the state of its slot, and writes the state
after every row into its verify rows (so the fold can pick any). q/k l2-norm, the scale,
`exp(g)`, `beta` and grouped value heads happen inside. fp32 state.

One program per (sequence, value head, block of `BV` value columns): a column's recurrence
reduces over the key dimension only, so the blocks are independent, the [dk, BV] state slice
stays in registers, and one sequence at Qwen3-Next-80B's widths (32 value heads, dv 128)
launches 256 programs."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gated_delta_rule.checks import check_inputs

# Value columns per program. From dv alone (never the batch), so a column's bytes do not depend
# on which sequences share the launch; 16 gives one sequence at dv 128 and 32 value heads 256
# programs, enough for the 132 SMs of an H100 / H200.
MAX_BV = 16


def _num_warps(slice_size: int) -> int:
    """About 16 state elements a thread, at most 4 warps: one warp for a 16 x 16 slice, 4 for
    128 x 16 (72 registers at sm_90, where 2 warps take 114 and one 200)."""
    return max(1, min(4, slice_size // 512))


@triton.jit
def _recurrent_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    state_ptr,
    out_ptr,
    rows_ptr,
    cu_ptr,
    slot_ptr,
    vrow_ptr,
    HK,
    HV,
    DK,
    DV,
    scale,
    WRITE_LIVE: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    i, h, j = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    hk = h // (HV // HK)
    lo, hi = tl.load(cu_ptr + i), tl.load(cu_ptr + i + 1)
    slot, vrow = tl.load(slot_ptr + i).to(tl.int64), tl.load(vrow_ptr + i).to(tl.int64)
    o_k, o_v = tl.arange(0, BK), j * BV + tl.arange(0, BV)
    m_k, m_v = o_k < DK, o_v < DV
    m_s = m_k[:, None] & m_v[None, :]
    o_s = (h * DK + o_k[:, None]) * DV + o_v[None, :]
    b_s = tl.load(state_ptr + slot * HV * DK * DV + o_s, mask=m_s, other=0.0).to(tl.float32)
    for t in range(lo, hi):
        b_q = tl.load(q_ptr + (t * HK + hk) * DK + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k_ptr + (t * HK + hk) * DK + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v_ptr + (t * HV + h) * DV + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6) * scale
        b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
        b_g = tl.load(g_ptr + t * HV + h).to(tl.float32)
        b_beta = tl.load(beta_ptr + t * HV + h).to(tl.float32)
        b_s = b_s * tl.exp(b_g)
        b_kv = tl.sum(b_s * b_k[:, None], axis=0)
        b_delta = (b_v - b_kv) * b_beta
        b_s = b_s + b_k[:, None] * b_delta[None, :]
        b_o = tl.sum(b_s * b_q[:, None], axis=0)
        tl.store(out_ptr + (t * HV + h) * DV + o_v, b_o, mask=m_v)
        tl.store(rows_ptr + (vrow + t - lo) * HV * DK * DV + o_s, b_s, mask=m_s)
    if WRITE_LIVE:
        tl.store(state_ptr + slot * HV * DK * DV + o_s, b_s, mask=m_s)


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    cu: torch.Tensor,
    slots: torch.Tensor,
    rows: torch.Tensor,
    vrows: torch.Tensor,
    write_live: bool,
) -> torch.Tensor:
    """q, k: [T, Hk, dk]; v: [T, Hv, dv]; g, beta: [T, Hv]; states: [slots, Hv, dk, dv] fp32
    (the live pool); rows: [pool, Hv, dk, dv] fp32 (verify rows; sequence i's row t goes to
    `vrows[i] + t`); cu: [n + 1], slots, vrows: [n]. `write_live` also leaves the last row's
    state live. -> o [T, Hv, dv] fp32"""
    t_rows, hk, hv, dk, dv = check_inputs(
        "recurrent_gated_delta_rule", q, k, v, g, beta, {"states": states, "rows": rows}
    )
    out = torch.empty(t_rows, hv, dv, dtype=torch.float32, device=q.device)
    bk, bv = triton.next_power_of_2(dk), min(triton.next_power_of_2(dv), MAX_BV)
    _recurrent_kernel[(len(slots), hv, triton.cdiv(dv, bv))](
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        g.contiguous(),
        beta.contiguous(),
        states,
        out,
        rows,
        cu,
        slots,
        vrows,
        hk,
        hv,
        dk,
        dv,
        dk**-0.5,
        WRITE_LIVE=write_live,
        BK=bk,
        BV=bv,
        num_warps=_num_warps(bk * bv),
    )
    return out
