"""A batch-invariant GEMM: `x @ W^T + bias` with the weight stored transposed (`[K, N]`).

Every output tile is one program's, computed with the same tile shape and the same order over
K whatever M is: no split-K, and no tile chosen by M (one tile shape for all). So
a row's bytes do not depend on how many rows share the call or where the row sits in it,
which cuBLAS does not promise (it picks its kernel by the shape). fp32 accumulates; bf16 and
fp16 operands go to `tl.dot` as they are on a GPU and upcast first under the interpreter,
whose low-precision `tl.dot` is not exact. fp32 operands multiply in IEEE fp32, not TF32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# (BM, BN, BK), one shape for every M and every dtype. 64 rows cover a decode batch in one
# tile; a 64 x 128 fp32 accumulator and three stages of operand tiles fit a GPU's registers
# and shared memory, fp32 operands included.
TILE = (64, 128, 64)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _matmul_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    o_ptr,
    M,
    N,
    K,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    o_m = tl.program_id(0) * BM + tl.arange(0, BM)
    o_n = tl.program_id(1) * BN + tl.arange(0, BN)
    m_m, m_n = o_m < M, o_n < N
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        b_x = tl.load(
            x_ptr + o_m[:, None] * K + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0
        )
        b_w = tl.load(
            w_ptr + o_k[:, None] * N + o_n[None, :], mask=m_k[:, None] & m_n[None, :], other=0.0
        )
        if UPCAST:
            acc += tl.dot(b_x.to(tl.float32), b_w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(b_x, b_w, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(b_ptr + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
    tl.store(
        o_ptr + o_m[:, None] * N + o_n[None, :],
        acc.to(o_ptr.dtype.element_ty),
        mask=m_m[:, None] & m_n[None, :],
    )


def matmul(
    x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x: [M, K], weight_t: [K, N], bias: [N] or None -> [M, N] in x's dtype"""
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
    m, k = x.shape
    n = weight_t.shape[1]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    bm, bn, bk = TILE
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _matmul_kernel[grid](
        x.contiguous(),
        weight_t.contiguous(),
        out if bias is None else bias.contiguous(),
        out,
        m,
        n,
        k,
        HAS_BIAS=bias is not None,
        UPCAST=x.device.type != "cuda" and x.dtype != torch.float32,  # the interpreter's
        BM=bm,
        BN=bn,
        BK=bk,
    )
    return out
