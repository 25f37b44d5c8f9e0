"""Attention of each sequence's new rows over its own KV cache (verify, decode, prefill and
the drafter): a varlen batch of query rows, grouped KV heads, causal by position, an optional
per-position validity mask (the drafter's). One program per (sequence, query head); queries in
blocks of `BM`, keys in blocks of `BN`, online softmax, fp32 accumulation."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BM, BN = 16, 16


@triton.jit
def _online_softmax(b_sc, b_v, b_acc, b_max, b_sum):
    """One key block into the running softmax. b_sc: [BM, BN] scores (-inf where unseen);
    b_v: [BN, BD]; b_acc: [BM, BD]; b_max, b_sum: [BM] -> (b_acc, b_max, b_sum) updated. A
    row that has seen no key yet keeps a max of -inf; its exps are taken from 0 instead."""
    b_new = tl.maximum(b_max, tl.max(b_sc, axis=1))
    b_safe = tl.where(b_new == float("-inf"), 0.0, b_new)
    b_p = tl.exp(b_sc - b_safe[:, None])
    b_alpha = tl.exp(b_max - b_safe)
    b_sum = b_sum * b_alpha + tl.sum(b_p, axis=1)
    b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p, b_v, input_precision="ieee")
    return b_acc, b_new, b_sum


@triton.jit
def _attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    valid_ptr,
    out_ptr,
    cu_ptr,
    slot_ptr,
    start_ptr,
    HQ,
    HKV,
    D,
    CTX,
    scale,
    HAS_VALID: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
):
    i, h = tl.program_id(0), tl.program_id(1)
    hkv = h // (HQ // HKV)
    lo, hi = tl.load(cu_ptr + i), tl.load(cu_ptr + i + 1)
    slot, start = tl.load(slot_ptr + i).to(tl.int64), tl.load(start_ptr + i)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    length = start + hi - lo
    for m0 in range(0, hi - lo, BM):
        o_m = m0 + tl.arange(0, BM)
        m_m = o_m < hi - lo
        q_pos = start + o_m
        b_q = tl.load(
            q_ptr + ((lo + o_m[:, None]) * HQ + h) * D + o_d[None, :],
            mask=m_m[:, None] & m_d[None, :],
            other=0.0,
        ).to(tl.float32)
        b_acc = tl.zeros([BM, BD], tl.float32)
        b_max = tl.full([BM], float("-inf"), tl.float32)
        b_sum = tl.zeros([BM], tl.float32)
        for n0 in range(0, length, BN):
            o_n = n0 + tl.arange(0, BN)
            m_n = o_n < length
            p_kv = ((slot * CTX + o_n[:, None]) * HKV + hkv) * D + o_d[None, :]
            b_k = tl.load(k_ptr + p_kv, mask=m_n[:, None] & m_d[None, :], other=0.0)
            b_v = tl.load(v_ptr + p_kv, mask=m_n[:, None] & m_d[None, :], other=0.0)
            b_k, b_v = b_k.to(tl.float32), b_v.to(tl.float32)
            b_sc = tl.dot(b_q, tl.trans(b_k), input_precision="ieee") * scale
            seen = (o_n[None, :] <= q_pos[:, None]) & m_n[None, :]
            if HAS_VALID:
                ok = tl.load(valid_ptr + slot * CTX + o_n, mask=m_n, other=0)
                seen = seen & (ok[None, :] != 0)
            b_sc = tl.where(seen, b_sc, float("-inf"))
            b_acc, b_max, b_sum = _online_softmax(b_sc, b_v, b_acc, b_max, b_sum)
        b_o = b_acc / tl.maximum(b_sum, 1e-30)[:, None]
        tl.store(
            out_ptr + ((lo + o_m[:, None]) * HQ + h) * D + o_d[None, :],
            b_o.to(out_ptr.dtype.element_ty),
            mask=m_m[:, None] & m_d[None, :],
        )


def attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    valid: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """q: [T, Hq, d], rows of sequence i at positions `starts[i] ..`; caches: [slots, ctx,
    Hkv, d] holding those rows already; valid: [slots, ctx] bool or None; scale: of the
    scores, `d ** -0.5` unless given (1 when q comes scaled). -> [T, Hq, d]"""
    rows, hq, dim = q.shape
    if k_cache.shape != v_cache.shape or k_cache.shape[-1] != dim or hq % k_cache.shape[2]:
        raise ValueError(
            f"attention: q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("attention: the KV caches must be contiguous")
    out = torch.empty_like(q)
    mask = valid.to(torch.int8).contiguous() if valid is not None else q
    _attention_kernel[(len(slots), hq)](
        q.contiguous(),
        k_cache,
        v_cache,
        mask,
        out,
        cu,
        slots,
        starts,
        hq,
        k_cache.shape[2],
        dim,
        k_cache.shape[1],
        dim**-0.5 if scale is None else scale,
        HAS_VALID=valid is not None,
        BM=BM,
        BN=BN,
        BD=max(16, triton.next_power_of_2(dim)),
    )
    return out
