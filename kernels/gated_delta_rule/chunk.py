"""Gated delta rule, chunked (WY) form, for prefill: per (sequence, value head) program, chunks
of `CHUNK` rows; within a chunk the UT transform `(I + A)^-1` by forward substitution, across
chunks the state recurrence; the initial state read from the slot and the final state written
back to it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gated_delta_rule.checks import check_inputs

CHUNK = 16


@triton.jit
def _load_rows(ptr, rows, m_t, HEADS, head, o_d, m_d, D):
    """Rows `rows` of head `head` of a [T, HEADS, D] tensor. -> [BT, BD] fp32"""
    p_x = ptr + (rows[:, None] * HEADS + head) * D + o_d[None, :]
    return tl.load(p_x, mask=m_t[:, None] & m_d[None, :], other=0.0).to(tl.float32)


@triton.jit
def _unit_lower_inverse(b_a, o_t, BT: tl.constexpr):
    """(I + A)^-1 for a strictly lower A, given -A: forward substitution, row by row."""
    for r in range(1, BT):
        b_row = tl.sum(tl.where(o_t[:, None] == r, b_a, 0.0), axis=0)
        b_upd = tl.sum(b_row[:, None] * b_a, axis=0)
        b_row = b_row + tl.where(o_t < r, b_upd, 0.0)
        b_a = tl.where(o_t[:, None] == r, b_row[None, :], b_a)
    return b_a + tl.where(o_t[:, None] == o_t[None, :], 1.0, 0.0)


@triton.jit
def _chunk(b_q, b_k, b_v, b_g, b_beta, b_s, o_t, BT: tl.constexpr):
    """One chunk from state `b_s`. b_q, b_k: [BT, BK] l2-normed; b_v: [BT, BV]; b_g (log-decays,
    summed over the chunk so far), b_beta: [BT]; b_s: [BK, BV] -> (o [BT, BV], state after)"""
    lower = o_t[:, None] >= o_t[None, :]
    # Exponentiate only the lower triangle: above it the difference can overflow.
    b_decay = tl.where(lower, tl.exp(tl.where(lower, b_g[:, None] - b_g[None, :], 0.0)), 0.0)
    b_kb = b_k * b_beta[:, None]
    b_a = tl.dot(b_kb, tl.trans(b_k), input_precision="ieee")
    b_a = _unit_lower_inverse(tl.where(o_t[:, None] > o_t[None, :], -b_a * b_decay, 0.0), o_t, BT)
    b_u = tl.dot(b_a, b_v * b_beta[:, None], input_precision="ieee")
    b_w = tl.dot(b_a, b_kb * tl.exp(b_g)[:, None], input_precision="ieee")
    b_vnew = b_u - tl.dot(b_w, b_s, input_precision="ieee")
    b_qk = tl.where(lower, tl.dot(b_q, tl.trans(b_k), input_precision="ieee") * b_decay, 0.0)
    b_o = tl.dot(b_q * tl.exp(b_g)[:, None], b_s, input_precision="ieee") + tl.dot(
        b_qk, b_vnew, input_precision="ieee"
    )
    b_last = tl.sum(tl.where(o_t == BT - 1, b_g, 0.0))
    b_tail = tl.exp(b_last - b_g)
    b_s = b_s * tl.exp(b_last) + tl.dot(
        tl.trans(b_k * b_tail[:, None]), b_vnew, input_precision="ieee"
    )
    return b_o, b_s


@triton.jit
def _chunk_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    state_ptr,
    out_ptr,
    cu_ptr,
    slot_ptr,
    HK,
    HV,
    DK,
    DV,
    scale,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    i, h = tl.program_id(0), tl.program_id(1)
    hk = h // (HV // HK)
    lo, hi = tl.load(cu_ptr + i), tl.load(cu_ptr + i + 1)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    o_t, o_k, o_v = tl.arange(0, BT), tl.arange(0, BK), tl.arange(0, BV)
    m_k, m_v = o_k < DK, o_v < DV
    o_s = (h * DK + o_k[:, None]) * DV + o_v[None, :]
    m_s = m_k[:, None] & m_v[None, :]
    b_s = tl.load(state_ptr + slot * HV * DK * DV + o_s, mask=m_s, other=0.0).to(tl.float32)
    for c0 in range(lo, hi, BT):
        rows = c0 + o_t
        m_t = rows < hi
        b_q = _load_rows(q_ptr, rows, m_t, HK, hk, o_k, m_k, DK)
        b_k = _load_rows(k_ptr, rows, m_t, HK, hk, o_k, m_k, DK)
        b_v = _load_rows(v_ptr, rows, m_t, HV, h, o_v, m_v, DV)
        b_g = tl.load(g_ptr + rows * HV + h, mask=m_t, other=0.0).to(tl.float32)
        b_beta = tl.load(beta_ptr + rows * HV + h, mask=m_t, other=0.0).to(tl.float32)
        b_q = b_q / tl.sqrt(tl.sum(b_q * b_q, axis=1) + 1e-6)[:, None] * scale
        b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, axis=1) + 1e-6)[:, None]
        b_o, b_s = _chunk(b_q, b_k, b_v, tl.cumsum(b_g, axis=0), b_beta, b_s, o_t, BT)
        p_o = out_ptr + (rows[:, None] * HV + h) * DV + o_v[None, :]
        tl.store(p_o, b_o, mask=m_t[:, None] & m_v[None, :])
    tl.store(state_ptr + slot * HV * DK * DV + o_s, b_s, mask=m_s)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    cu: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """Shapes as the recurrent kernel; each slot's state in `states` advances to the end of
    its sequence. -> o [T, Hv, dv] fp32"""
    t_rows, hk, hv, dk, dv = check_inputs(
        "chunk_gated_delta_rule", q, k, v, g, beta, {"states": states}
    )
    out = torch.empty(t_rows, hv, dv, dtype=torch.float32, device=q.device)
    # tl.dot wants every block dim of at least 16.
    bk, bv = max(16, triton.next_power_of_2(dk)), max(16, triton.next_power_of_2(dv))
    _chunk_kernel[(len(slots), hv)](
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        g.contiguous(),
        beta.contiguous(),
        states,
        out,
        cu,
        slots,
        hk,
        hv,
        dk,
        dv,
        dk**-0.5,
        BT=CHUNK,
        BK=bk,
        BV=bv,
    )
    return out
