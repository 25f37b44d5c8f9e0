"""A batch-invariant GEMM: `x @ W^T + bias` with the weight stored transposed (`[K, N]`).

One tile shape for every M, and one order of the sums over K chosen from N and K alone: K is
cut into `splits` runs of whole BK blocks (enough to give one decode row about a program per
SM), each run summed in block order from zero, the runs' fp32 sums added in split order from
zero, the bias last, then one cast. A row's bytes therefore do not depend on how many rows
share the call or where the row sits in it, which cuBLAS does not promise (it picks its kernel
by the shape).

Who adds the runs depends on M, the bytes do not. While the rows fit one row tile (decode,
verify) each run is a program of its own: the grid is row tiles x column tiles x splits, the
runs' sums go to an fp32 workspace `[splits, M, N]` and a second kernel adds them in split
order. Past one row tile the workspace's traffic (8 * splits * M * N bytes) would pass the
weights' (2 * K * N at the flagship's widths) and each program walks its tile's runs itself,
in the same order. Both are the one compiled kernel, so the additions are the same
instructions.

fp32 accumulates; bf16 and fp16 operands go to `tl.dot` as they are on a GPU and upcast first
under the interpreter, whose low-precision `tl.dot` is not exact. fp32 operands multiply in
IEEE fp32, not TF32."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# (BM, BN, BK) by operand dtype, one shape for every M. 64 rows cover a decode batch in one
# tile. bf16 and fp16 go to the tensor cores; fp32 (IEEE, not TF32) to the FMA units, which
# hold a block's slice of K of both operands in registers: a narrower block keeps them there.
TILES = {
    torch.bfloat16: (64, 128, 64),
    torch.float16: (64, 128, 64),
    torch.float32: (64, 128, 16),
}
DTYPES = tuple(TILES)
# Two 64 x 128 fp32 sums (a split's and the total) and the operand tiles fit 8 warps'
# registers without spilling on sm_80/90/100; 4 warps spill.
NUM_WARPS = 8
# Programs that one row tile should make: about one per SM of an H100/H200 (132) keeps enough
# weight loads in flight to stream the weights at memory speed for a single row.
TARGET_PROGRAMS = 128
# Elements of the output that one program of the split-summing kernel adds.
SUM_BLOCK = 4096


@dataclass(frozen=True)
class MatmulPlan:
    """How `matmul` runs an [M, K] @ [K, N] product. `splits` and `split_blocks` fix the
    arithmetic (from N, K and the dtype alone); the rest follow from them and M."""

    splits: int  # runs of K, each summed on its own, added in this order
    split_blocks: int  # BK blocks in each run (the last run may have fewer)
    tiles: int  # output tiles, row tiles x column tiles
    programs: int  # programs of the GEMM kernel
    sum_programs: int  # programs of the kernel that adds the splits (0: none runs)
    workspace_bytes: int  # the fp32 sums of the splits, [splits, M, N] (0: none)


def split_k(n: int, k: int, dtype: torch.dtype = torch.bfloat16) -> tuple[int, int]:
    """(splits, BK blocks per split) for an [., K] @ [K, N] product: the fewest splits that
    bring a row tile's programs to TARGET_PROGRAMS, no split empty. Never depends on M."""
    _, bn, bk = TILES[dtype]
    k_blocks = max(1, triton.cdiv(k, bk))
    want = min(k_blocks, triton.cdiv(TARGET_PROGRAMS, triton.cdiv(n, bn)))
    split_blocks = triton.cdiv(k_blocks, want)
    return triton.cdiv(k_blocks, split_blocks), split_blocks


def plan(m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16) -> MatmulPlan:
    """The launch `matmul` makes for x: [M, K], weight_t: [K, N] of `dtype`, without making
    it."""
    bm, bn, _ = TILES[dtype]
    splits, split_blocks = split_k(n, k, dtype)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    if m > bm or splits == 1:
        return MatmulPlan(splits, split_blocks, tiles, tiles, 0, 0)
    sums = triton.cdiv(m * n, SUM_BLOCK)
    return MatmulPlan(splits, split_blocks, tiles, tiles * splits, sums, splits * m * n * 4)


# M and the splits per program vary with the row count: a value of 1 must not compile a
# kernel of its own, whose code could add in another way. A run of one block would too, and
# with more registers.
@triton.jit(do_not_specialize=["M", "split_blocks", "splits_per_program"])
def _matmul_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    o_ptr,
    ws_ptr,
    M,
    N,
    K,
    split_blocks,
    splits_per_program,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    o_m = tl.program_id(0) * BM + tl.arange(0, BM)
    o_n = tl.program_id(1) * BN + tl.arange(0, BN)
    m_m, m_n = o_m < M, o_n < N
    k_blocks = tl.cdiv(K, BK)
    s0 = tl.program_id(2) * splits_per_program
    b_o = tl.zeros([BM, BN], dtype=tl.float32)
    for s in range(s0, s0 + splits_per_program):
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for kb in range(s * split_blocks, tl.minimum(s * split_blocks + split_blocks, k_blocks)):
            o_k = kb * BK + tl.arange(0, BK)
            m_k = o_k < K
            b_x = tl.load(
                x_ptr + o_m[:, None] * K + o_k[None, :],
                mask=m_m[:, None] & m_k[None, :],
                other=0.0,
            )
            b_w = tl.load(
                w_ptr + o_k[:, None] * N + o_n[None, :],
                mask=m_k[:, None] & m_n[None, :],
                other=0.0,
            )
            if UPCAST:
                acc += tl.dot(b_x.to(tl.float32), b_w.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(b_x, b_w, input_precision="ieee")
        b_o += acc
    mask = m_m[:, None] & m_n[None, :]
    if tl.num_programs(2) == 1:
        if HAS_BIAS:
            b_o += tl.load(b_ptr + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
        tl.store(o_ptr + o_m[:, None] * N + o_n[None, :], b_o.to(o_ptr.dtype.element_ty), mask=mask)
    else:
        p_ws = ws_ptr + tl.program_id(2) * M * N + o_m[:, None] * N + o_n[None, :]
        tl.store(p_ws, b_o, mask=mask)


@triton.jit
def _sum_splits_kernel(
    ws_ptr, b_ptr, o_ptr, M, N, splits, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr
):
    """The GEMM's additions after its K loop, element by element: from zero, the splits in
    order, then the bias."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = o < M * N
    b_o = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(splits):
        b_o += tl.load(ws_ptr + s * M * N + o, mask=mask, other=0.0)
    if HAS_BIAS:
        b_o += tl.load(b_ptr + o % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptr + o, b_o.to(o_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight_t.dim() != 2 or x.shape[1] != weight_t.shape[0]:
        raise ValueError(
            f"matmul: x {tuple(x.shape)} and weight_t {tuple(weight_t.shape)} do not multiply "
            "([M, K] @ [K, N])"
        )
    if x.dtype != weight_t.dtype or x.dtype not in DTYPES:
        raise ValueError(
            f"matmul: x is {x.dtype} and weight_t {weight_t.dtype}; both must be one of "
            f"{', '.join(str(d) for d in DTYPES)}"
        )
    if bias is not None and bias.shape != (weight_t.shape[1],):
        raise ValueError(f"matmul: bias {tuple(bias.shape)} for {weight_t.shape[1]} outputs")


def matmul(
    x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x: [M, K], weight_t: [K, N], bias: [N] or None -> [M, N] in x's dtype"""
    _check(x, weight_t, bias)
    m, k = x.shape
    n = weight_t.shape[1]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    bm, bn, bk = TILES[x.dtype]
    p = plan(m, n, k, x.dtype)
    split_programs = p.sum_programs > 0
    # fp32 in both modes, or the two would be different compiled kernels.
    ws = torch.empty(p.splits if split_programs else 0, m, n, dtype=torch.float32, device=x.device)
    bias_or_out = out if bias is None else bias.contiguous()
    _matmul_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn), p.splits if split_programs else 1)](
        x.contiguous(),
        weight_t.contiguous(),
        bias_or_out,
        out,
        ws,
        m,
        n,
        k,
        p.split_blocks,
        1 if split_programs else p.splits,
        HAS_BIAS=bias is not None,
        UPCAST=x.device.type == "cpu" and x.dtype != torch.float32,  # the interpreter's
        BM=bm,
        BN=bn,
        BK=bk,
        num_warps=NUM_WARPS,
    )
    if split_programs:
        _sum_splits_kernel[(p.sum_programs,)](
            ws, bias_or_out, out, m, n, p.splits, HAS_BIAS=bias is not None, BLOCK=SUM_BLOCK
        )
    return out
