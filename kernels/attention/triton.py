"""Attention of each sequence's new rows over its own KV cache (verify, decode, prefill and
the drafter): a varlen batch of query rows, grouped KV heads, causal by position, an optional
per-position validity mask (the drafter's). Queries in blocks of `BM`, keys in blocks of `BN`,
online softmax, fp32 accumulation. On a GPU with 16-bit caches both products take 16-bit
operands (tensor cores), the probabilities rounded to the caches' dtype before the product
with the values, as FlashAttention does and `naive.py` does; in fp32 and on the CPU (the
interpreter) every product is fp32.

A row's keys are cut into splits (flash-decoding) by the row's own key count n (its position
+ 1) alone: splits of `split_size(n)` keys, a multiple of BN at least MIN_KEYS_PER_SPLIT, so
that at most MAX_SPLITS cover n. Each split gives a partial (running max, sum, unnormalised
accumulator); the partials are folded in split order. A key block outside a row's split is an
exact no-op for that row, so a row's bytes depend on nothing but its own keys: not on the batch,
nor on the other rows of its sequence (a verify row equals the same row decoded alone), nor on
the path, `split_keys`:
- True (verify, decode, the drafter: few rows a sequence): a program per (sequence, query
  head, split) writes its partials to an fp32 workspace (`workspace_bytes`) and a second kernel
  folds them; a long context then fills the GPU.
- False (prefill): a program per (sequence, query head, query block) walks its splits in turn
  and folds each as it is made, with the same functions; no workspace, which at a prefill's
  row count would take gigabytes, and the query blocks fill the GPU already."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention import splits
from kernels.attention.splits import BN, workspace_bytes

BM = 16


@triton.jit
def _fold(b_max, b_sum, b_acc, p_max, p_sum, p_acc):
    """A split's partial (p_max, p_sum: [BM]; p_acc: [BM, BD]) into the running fold of the
    splits before it. A partial that saw no key (-inf, 0, 0) leaves the fold's bytes as they
    are; a row that has seen no key in any split stays (-inf, 0, 0)."""
    b_new = tl.maximum(b_max, p_max)
    b_safe = tl.where(b_new == float("-inf"), 0.0, b_new)
    b_old, b_part = tl.exp(b_max - b_safe), tl.exp(p_max - b_safe)
    b_sum = b_sum * b_old + p_sum * b_part
    b_acc = b_acc * b_old[:, None] + p_acc * b_part[:, None]
    return b_new, b_sum, b_acc


@triton.jit
def _row_pos(start, o_m, m_m, count, CAUSAL: tl.constexpr):
    """The last key position each row sees (-1: a padding row): its own (`CAUSAL`), or its
    sequence's last row's (a block that sees itself whole)."""
    if CAUSAL:
        return tl.where(m_m, start + o_m, -1)
    return tl.where(m_m, start + count - 1, -1)


@triton.jit
def _splits(q_pos, MIN_KEYS: tl.constexpr, MAX_SPLITS: tl.constexpr, BN: tl.constexpr):
    """q_pos: [BM] positions (-1: a padding row) -> (keys a row sees n, its split size, its
    split count), each [BM]: see `split_size`."""
    n = q_pos + 1
    need = (n + MAX_SPLITS - 1) // MAX_SPLITS
    size = tl.maximum((need + BN - 1) // BN * BN, MIN_KEYS)
    return n, size, (n + size - 1) // size


@triton.jit
def _split_partial(
    b_q,
    k_ptr,
    v_ptr,
    valid_ptr,
    slot,
    hkv,
    HKV,
    D,
    table_ptr,
    MAXB,
    PAGE,
    scale,
    k_lo,
    k_hi,
    HAS_VALID: tl.constexpr,
    LOW: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
):
    """Row r's softmax partial over its keys k_lo[r] <= j < k_hi[r] (none where k_lo >= k_hi).
    b_q: [BM, BD], fp32 unless LOW; k_lo, k_hi: [BM], multiples of BN where not empty ->
    (b_max, b_sum: [BM], b_acc: [BM, BD]). The key blocks walked are the union of the rows'
    ranges; a block out of a row's range is an exact no-op for it."""
    BM: tl.constexpr = b_q.shape[0]
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    live = k_lo < k_hi
    first = tl.min(tl.where(live, k_lo, 1 << 30))
    last = tl.max(tl.where(live, k_hi, 0))
    b_acc = tl.zeros([BM, BD], tl.float32)
    b_max = tl.full([BM], float("-inf"), tl.float32)
    b_sum = tl.zeros([BM], tl.float32)
    for n0 in range(first, last, BN):
        o_n = n0 + tl.arange(0, BN)
        m_n = o_n < last
        # Key j of the slot: row j % PAGE of its block, the table's entry j // PAGE.
        blk = tl.load(table_ptr + slot * MAXB + o_n // PAGE, mask=m_n, other=0).to(tl.int64)
        phys = blk * PAGE + o_n % PAGE
        p_kv = (phys[:, None] * HKV + hkv) * D + o_d[None, :]
        b_k = tl.load(k_ptr + p_kv, mask=m_n[:, None] & m_d[None, :], other=0.0)
        b_v = tl.load(v_ptr + p_kv, mask=m_n[:, None] & m_d[None, :], other=0.0)
        if LOW:
            b_sc = tl.dot(b_q, tl.trans(b_k)) * scale
        else:
            b_k, b_v = b_k.to(tl.float32), b_v.to(tl.float32)
            b_sc = tl.dot(b_q, tl.trans(b_k), input_precision="ieee") * scale
        seen = (o_n[None, :] >= k_lo[:, None]) & (o_n[None, :] < k_hi[:, None])
        if HAS_VALID:
            ok = tl.load(valid_ptr + phys, mask=m_n, other=0)
            seen = seen & (ok[None, :] != 0)
        b_sc = tl.where(seen, b_sc, float("-inf"))
        # Online softmax; a row that has seen no key yet keeps a max of -inf, and its exps are
        # taken from 0 instead.
        b_new = tl.maximum(b_max, tl.max(b_sc, axis=1))
        b_safe = tl.where(b_new == float("-inf"), 0.0, b_new)
        b_p = tl.exp(b_sc - b_safe[:, None])
        b_alpha = tl.exp(b_max - b_safe)
        b_sum = b_sum * b_alpha + tl.sum(b_p, axis=1)
        if LOW:
            b_pv = tl.dot(b_p.to(b_v.dtype), b_v)
        else:
            b_pv = tl.dot(b_p, b_v, input_precision="ieee")
        b_acc = b_acc * b_alpha[:, None] + b_pv
        b_max = b_new
    return b_max, b_sum, b_acc


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
    table_ptr,
    MAXB,
    PAGE,
    scale,
    HAS_VALID: tl.constexpr,
    LOW: tl.constexpr,
    CAUSAL: tl.constexpr,
    MIN_KEYS: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
):
    """Program (sequence i, query head h, query block b): the block's rows, every split in
    turn, folded as made."""
    i, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    hkv = h // (HQ // HKV)
    lo, hi = tl.load(cu_ptr + i), tl.load(cu_ptr + i + 1)
    slot, start = tl.load(slot_ptr + i).to(tl.int64), tl.load(start_ptr + i)
    o_m = b * BM + tl.arange(0, BM)
    m_m = o_m < hi - lo
    if b * BM < hi - lo:
        o_d = tl.arange(0, BD)
        m_d = o_d < D
        p_q = ((lo + o_m[:, None]) * HQ + h) * D + o_d[None, :]
        b_q = tl.load(q_ptr + p_q, mask=m_m[:, None] & m_d[None, :], other=0.0)
        if not LOW:
            b_q = b_q.to(tl.float32)
        n, size, count = _splits(
            _row_pos(start, o_m, m_m, hi - lo, CAUSAL), MIN_KEYS, MAX_SPLITS, BN
        )
        b_acc = tl.zeros([BM, BD], tl.float32)
        b_max = tl.full([BM], float("-inf"), tl.float32)
        b_sum = tl.zeros([BM], tl.float32)
        for j in range(0, tl.max(count)):
            k_lo = j * size
            p_max, p_sum, p_acc = _split_partial(
                b_q,
                k_ptr,
                v_ptr,
                valid_ptr,
                slot,
                hkv,
                HKV,
                D,
                table_ptr,
                MAXB,
                PAGE,
                scale,
                k_lo,
                tl.minimum(k_lo + size, n),
                HAS_VALID,
                LOW,
                BN,
                BD,
            )
            b_max, b_sum, b_acc = _fold(b_max, b_sum, b_acc, p_max, p_sum, p_acc)
        b_o = b_acc / tl.maximum(b_sum, 1e-30)[:, None]
        tl.store(out_ptr + p_q, b_o.to(out_ptr.dtype.element_ty), mask=m_m[:, None] & m_d[None, :])


@triton.jit
def _split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    valid_ptr,
    acc_ptr,
    stat_ptr,
    cu_ptr,
    slot_ptr,
    start_ptr,
    HQ,
    HKV,
    D,
    table_ptr,
    MAXB,
    PAGE,
    scale,
    HAS_VALID: tl.constexpr,
    LOW: tl.constexpr,
    CAUSAL: tl.constexpr,
    MIN_KEYS: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
):
    """Program (sequence i, query head h, split j): split j of each of the sequence's rows
    into the workspace: acc [T, HQ, MAX_SPLITS, D], stat [T, HQ, MAX_SPLITS, 2] (max, sum).
    A row with fewer splits has nothing written there; a program past every row's split count
    loads no key."""
    i, h, j = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    hkv = h // (HQ // HKV)
    lo, hi = tl.load(cu_ptr + i), tl.load(cu_ptr + i + 1)
    slot, start = tl.load(slot_ptr + i).to(tl.int64), tl.load(start_ptr + i)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    for m0 in range(0, hi - lo, BM):
        o_m = m0 + tl.arange(0, BM)
        m_m = o_m < hi - lo
        n, size, count = _splits(
            _row_pos(start, o_m, m_m, hi - lo, CAUSAL), MIN_KEYS, MAX_SPLITS, BN
        )
        if j < tl.max(count):
            p_q = ((lo + o_m[:, None]) * HQ + h) * D + o_d[None, :]
            b_q = tl.load(q_ptr + p_q, mask=m_m[:, None] & m_d[None, :], other=0.0)
            if not LOW:
                b_q = b_q.to(tl.float32)
            k_lo = j * size
            b_max, b_sum, b_acc = _split_partial(
                b_q,
                k_ptr,
                v_ptr,
                valid_ptr,
                slot,
                hkv,
                HKV,
                D,
                table_ptr,
                MAXB,
                PAGE,
                scale,
                k_lo,
                tl.minimum(k_lo + size, n),
                HAS_VALID,
                LOW,
                BN,
                BD,
            )
            m_w = j < count
            o_w = ((lo + o_m).to(tl.int64) * HQ + h) * MAX_SPLITS + j  # [BM] partial index
            tl.store(
                acc_ptr + o_w[:, None] * D + o_d[None, :],
                b_acc,
                mask=m_w[:, None] & m_d[None, :],
            )
            tl.store(stat_ptr + o_w * 2, b_max, mask=m_w)
            tl.store(stat_ptr + o_w * 2 + 1, b_sum, mask=m_w)


@triton.jit
def _combine_kernel(
    acc_ptr,
    stat_ptr,
    out_ptr,
    cu_ptr,
    start_ptr,
    HQ,
    D,
    CAUSAL: tl.constexpr,
    MIN_KEYS: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
):
    """Program (sequence i, query head h): each row's partials folded in split order."""
    i, h = tl.program_id(0), tl.program_id(1)
    lo, hi = tl.load(cu_ptr + i), tl.load(cu_ptr + i + 1)
    start = tl.load(start_ptr + i)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    for m0 in range(0, hi - lo, BM):
        o_m = m0 + tl.arange(0, BM)
        m_m = o_m < hi - lo
        _, _, count = _splits(_row_pos(start, o_m, m_m, hi - lo, CAUSAL), MIN_KEYS, MAX_SPLITS, BN)
        b_acc = tl.zeros([BM, BD], tl.float32)
        b_max = tl.full([BM], float("-inf"), tl.float32)
        b_sum = tl.zeros([BM], tl.float32)
        for j in range(0, tl.max(count)):
            m_w = j < count
            o_w = ((lo + o_m).to(tl.int64) * HQ + h) * MAX_SPLITS + j
            p_max = tl.load(stat_ptr + o_w * 2, mask=m_w, other=float("-inf"))
            p_sum = tl.load(stat_ptr + o_w * 2 + 1, mask=m_w, other=0.0)
            p_acc = tl.load(
                acc_ptr + o_w[:, None] * D + o_d[None, :],
                mask=m_w[:, None] & m_d[None, :],
                other=0.0,
            )
            b_max, b_sum, b_acc = _fold(b_max, b_sum, b_acc, p_max, p_sum, p_acc)
        b_o = b_acc / tl.maximum(b_sum, 1e-30)[:, None]
        p_o = ((lo + o_m[:, None]) * HQ + h) * D + o_d[None, :]
        tl.store(out_ptr + p_o, b_o.to(out_ptr.dtype.element_ty), mask=m_m[:, None] & m_d[None, :])


def _constants(dim: int) -> dict[str, int]:
    """The kernels' compile-time sizes at head dim `dim`, the split rule read at each call so
    that a test can change it. Warps and stages as measured spill-free (`cuobjdump`: no stack)
    at 16-bit and fp32 for sm_80/90/100 at head dims 16 to 128 and for sm_90 at 256 (Qwen3-
    Next); 8 warps below 256, or 3 stages, spilled the prefill kernel at some of them."""
    bd = max(16, triton.next_power_of_2(dim))
    return {
        "MIN_KEYS": splits.MIN_KEYS_PER_SPLIT,
        "MAX_SPLITS": splits.MAX_SPLITS,
        "BM": BM,
        "BN": BN,
        "BD": bd,
        "num_warps": 8 if bd >= 256 else 4,
        "num_stages": 2,
    }


def _low(q: torch.Tensor) -> bool:
    """Whether the products take 16-bit operands (tensor cores, fp32 accumulation): on a GPU
    (and `meta`, which stands for one) with 16-bit activations. The interpreter's 16-bit
    `tl.dot` is wrong, so on the CPU the operands go up to fp32."""
    return q.dtype != torch.float32 and q.device.type != "cpu"


def _table(k_cache: torch.Tensor, table: torch.Tensor | None) -> torch.Tensor:
    """The block table the kernels read: `table`, or for a flat cache one page a slot."""
    if table is None:
        return torch.arange(k_cache.shape[0], dtype=torch.int32, device=k_cache.device)[:, None]
    if table.dtype != torch.int32 or not table.is_contiguous():
        raise ValueError("attention: the block table must be contiguous int32")
    return table


def split_partials(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    valid: torch.Tensor | None,
    scale: float,
    workspace: torch.Tensor,
    table: torch.Tensor | None = None,
    causal: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first kernel of the `split_keys` path, into `workspace`: fp32, at least
    `workspace_bytes(T, Hq, d) / 4` elements. -> (acc [T, Hq, MAX_SPLITS, d], stat [T, Hq,
    MAX_SPLITS, 2]: max, sum), views of it; entries past a row's split count are not written."""
    rows, hq, dim = q.shape
    table = _table(k_cache, table)
    most = splits.MAX_SPLITS
    acc = workspace[: rows * hq * most * dim].view(rows, hq, most, dim)
    stat = workspace[acc.numel() : acc.numel() + rows * hq * most * 2].view(rows, hq, most, 2)
    mask = valid.to(torch.int8).contiguous() if valid is not None else q
    _split_kernel[(len(slots), hq, most)](
        q,
        k_cache,
        v_cache,
        mask,
        acc,
        stat,
        cu,
        slots,
        starts,
        hq,
        k_cache.shape[2],
        dim,
        table,
        table.shape[1],
        k_cache.shape[1],
        scale,
        HAS_VALID=valid is not None,
        LOW=_low(q),
        CAUSAL=causal,
        **_constants(dim),
    )
    return acc, stat


def attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    valid: torch.Tensor | None = None,
    scale: float | None = None,
    split_keys: bool = True,
    table: torch.Tensor | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """q: [T, Hq, d], rows of sequence i at positions `starts[i] ..`; caches: paged pools
    [blocks, page, Hkv, d] read through `table` [slots, blocks a sequence] int32 (position j of
    a slot: row j % page of block table[slot, j // page]), or with no table flat caches [slots,
    ctx, Hkv, d], holding those rows already; valid: the pools' [blocks, page] (flat: [slots,
    ctx]) bool or None; scale: of the
    scores, `d ** -0.5` unless given (1 when q comes scaled); split_keys: a program per split
    and a workspace of `workspace_bytes(T, Hq, d)` (calls of few rows a sequence), else a
    program per query block (prefill). Both run the same arithmetic, in the same order (the
    interpreted tests pin equal bytes). `causal` False: every row of a sequence sees the keys
    up to its last row (a DFlash block, non-causal inside itself).
    T * Hq * d < 2**31. -> [T, Hq, d]"""
    rows, hq, dim = q.shape
    if k_cache.shape != v_cache.shape or k_cache.shape[-1] != dim or hq % k_cache.shape[2]:
        raise ValueError(
            f"attention: q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("attention: the KV caches must be contiguous")
    q, out = q.contiguous(), torch.empty_like(q)
    scale = dim**-0.5 if scale is None else scale
    if split_keys:
        workspace = torch.empty(
            workspace_bytes(rows, hq, dim) // 4, device=q.device, dtype=torch.float32
        )
        acc, stat = split_partials(
            q, k_cache, v_cache, cu, slots, starts, valid, scale, workspace, table, causal
        )
        grid = (len(slots), hq)
        _combine_kernel[grid](acc, stat, out, cu, starts, hq, dim, causal, **_constants(dim))
        return out
    mask = valid.to(torch.int8).contiguous() if valid is not None else q
    table = _table(k_cache, table)
    _attention_kernel[(len(slots), hq, triton.cdiv(rows, BM))](
        q,
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
        table,
        table.shape[1],
        k_cache.shape[1],
        scale,
        HAS_VALID=valid is not None,
        LOW=_low(q),
        CAUSAL=causal,
        **_constants(dim),
    )
    return out
