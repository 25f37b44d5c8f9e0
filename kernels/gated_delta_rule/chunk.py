"""Gated delta rule, chunked (WY) form, for prefill: chunks of `CHUNK` rows; within a chunk the
UT transform `(I + A)^-1` by forward substitution, across chunks the state recurrence; the
initial state read from the slot and the final state written back to it.

One program per (sequence, value head, block of `BV` value columns), as in the recurrent form:
the [dk, BV] state slice stays in registers for the whole sequence, and one sequence at
Qwen3-Next-80B's widths launches 256 programs. Each program recomputes the chunk's
V-independent matrices (k k^T, q k^T, the inverse) from q, k, g and beta.

The products over dk (k k^T, q k^T, k S, q S) are reductions, one row of k and q at a time,
not `tl.dot`: Triton's fp32 dot holds each thread's whole dk-long operand rows in registers,
and four such dots at dk = 128 spill. Chunks stay at 16 rows: the products are fp32 on CUDA
cores, so a longer chunk buys no tensor-core efficiency, only more work per row, and its
[CHUNK, dk] q and k tiles outgrow the registers (at dk = 128, 32 rows spill at 4 warps and 64
at 8); the state stays in registers between chunks, so a longer chunk saves no memory traffic
either."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gated_delta_rule.checks import check_inputs

CHUNK = 16
# Value columns per program, from nothing but the kernel (so never from the batch): one
# sequence at dv 128 and 32 value heads launches 256 programs. tl.dot wants at least 16.
BV = 16
# At dk 128, 4 warps: ptxas for sm_100 would take 8 bytes of stack past its own register choice
# (sm_80 and sm_90 fit in 168); a cap it allocates under keeps every target spill-free.
MAX_REGISTERS = 192


@triton.jit
def _load_rows(ptr, rows, m_t, HEADS, head, o_d, m_d, D):
    """Rows `rows` of head `head` of a [T, HEADS, D] tensor. -> [BT, BD] fp32"""
    p_x = ptr + (rows[:, None] * HEADS + head) * D + o_d[None, :]
    return tl.load(p_x, mask=m_t[:, None] & m_d[None, :], other=0.0).to(tl.float32)


@triton.jit
def _dk_products(
    b_s, b_k, b_q, p_k, p_q, stride, n, o_t, o_k, m_k, BT: tl.constexpr, BV: tl.constexpr
):
    """The chunk's products over dk, from raw (not yet normalised) q and k. b_s: [BK, BV];
    b_k, b_q: [BT, BK], rows from `n` on zero; p_k, p_q: the chunk's first row of k and q,
    rows `stride` apart. -> (k k^T, q k^T: [BT, BT]; k S, q S: [BT, BV])"""
    b_kk = tl.zeros([BT, BT], tl.float32)
    b_qk = tl.zeros([BT, BT], tl.float32)
    b_ks = tl.zeros([BT, BV], tl.float32)
    b_qs = tl.zeros([BT, BV], tl.float32)
    p_k, p_q = p_k + o_k, p_q + o_k
    for r in range(tl.minimum(n, BT)):
        b_kr = tl.load(p_k, mask=m_k, other=0.0).to(tl.float32)
        b_qr = tl.load(p_q, mask=m_k, other=0.0).to(tl.float32)
        b_ksr, b_qsr = tl.split(tl.sum(tl.join(b_s * b_kr[:, None], b_s * b_qr[:, None]), 0))
        b_kkr, b_qkr = tl.split(tl.sum(tl.join(b_k * b_kr[None, :], b_q * b_kr[None, :]), 1))
        b_ks = tl.where(o_t[:, None] == r, b_ksr[None, :], b_ks)
        b_qs = tl.where(o_t[:, None] == r, b_qsr[None, :], b_qs)
        b_kk = tl.where(o_t[None, :] == r, b_kkr[:, None], b_kk)
        b_qk = tl.where(o_t[None, :] == r, b_qkr[:, None], b_qk)
        p_k, p_q = p_k + stride, p_q + stride
    return b_kk, b_qk, b_ks, b_qs


@triton.jit
def _unit_lower_inverse(b_a, o_t, BT: tl.constexpr):
    """(I + A)^-1 for a strictly lower A, given -A: forward substitution, a row at a time.
    Row r of the product is row r of -A times the rows above it, already final; the product's
    other rows, and its columns from r on, are exact zeros."""
    o_r = o_t[:, None]
    for r in range(1, BT):
        b_a += tl.dot(tl.where(o_r == r, b_a, 0.0), b_a, input_precision="ieee")
    return b_a + tl.where(o_t[:, None] == o_t[None, :], 1.0, 0.0)


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
    i, h, j = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    hk = h // (HV // HK)
    lo, hi = tl.load(cu_ptr + i), tl.load(cu_ptr + i + 1)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    o_t, o_k, o_v = tl.arange(0, BT), tl.arange(0, BK), j * BV + tl.arange(0, BV)
    m_k, m_v = o_k < DK, o_v < DV
    o_s = (h * DK + o_k[:, None]) * DV + o_v[None, :]
    m_s = m_k[:, None] & m_v[None, :]
    b_s = tl.load(state_ptr + slot * HV * DK * DV + o_s, mask=m_s, other=0.0).to(tl.float32)
    lower = o_t[:, None] >= o_t[None, :]
    for c0 in range(lo, hi, BT):
        rows = c0 + o_t
        m_t = rows < hi
        b_q = _load_rows(q_ptr, rows, m_t, HK, hk, o_k, m_k, DK)
        b_k = _load_rows(k_ptr, rows, m_t, HK, hk, o_k, m_k, DK)
        b_v = _load_rows(v_ptr, rows, m_t, HV, h, o_v, m_v, DV)
        b_g = tl.cumsum(tl.load(g_ptr + rows * HV + h, mask=m_t, other=0.0).to(tl.float32), 0)
        b_beta = tl.load(beta_ptr + rows * HV + h, mask=m_t, other=0.0).to(tl.float32)
        # The l2 norms as row scales of the products: [BT].
        rq = scale / tl.sqrt(tl.sum(b_q * b_q, axis=1) + 1e-6)
        rk = 1.0 / tl.sqrt(tl.sum(b_k * b_k, axis=1) + 1e-6)
        p_r = (c0 * HK + hk) * DK
        b_kk, b_qk, b_ks, b_qs = _dk_products(
            b_s, b_k, b_q, k_ptr + p_r, q_ptr + p_r, HK * DK, hi - c0, o_t, o_k, m_k, BT, BV
        )
        # Exponentiate only the lower triangle: above it the difference can overflow.
        b_decay = tl.where(lower, tl.exp(tl.where(lower, b_g[:, None] - b_g[None, :], 0.0)), 0.0)
        b_a = b_kk * b_decay * (b_beta * rk)[:, None] * rk[None, :]
        b_a = _unit_lower_inverse(tl.where(o_t[:, None] > o_t[None, :], -b_a, 0.0), o_t, BT)
        # (I + A)^-1 (v beta - (k beta exp(g)) S): the WY form's u - w S.
        b_x = (b_v - b_ks * (rk * tl.exp(b_g))[:, None]) * b_beta[:, None]
        b_vnew = tl.dot(b_a, b_x, input_precision="ieee")
        b_qk = b_qk * b_decay * rq[:, None] * rk[None, :]
        b_o = tl.dot(b_qk, b_vnew, b_qs * (rq * tl.exp(b_g))[:, None], input_precision="ieee")
        b_last = tl.sum(tl.where(o_t == BT - 1, b_g, 0.0))
        b_u = b_vnew * (rk * tl.exp(b_last - b_g))[:, None]
        b_s = tl.dot(tl.trans(b_k), b_u, b_s * tl.exp(b_last), input_precision="ieee")
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
    bk = max(16, triton.next_power_of_2(dk))
    _chunk_kernel[(len(slots), hv, triton.cdiv(dv, BV))](
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
        BV=BV,
        maxnreg=MAX_REGISTERS,
    )
    return out
