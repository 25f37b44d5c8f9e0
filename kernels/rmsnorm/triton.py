"""RMSNorm (zero-centred, `(1 + w) * rmsnorm(x)`) and the gated form of the GDN output
(`w * rmsnorm(x) * silu(z)`), one program per block of rows, fp32 inside.

A program holds its rows whole. The block's rows and the program's warps follow from the
width alone, so a row is reduced the same way whatever the row count."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# fp32 values of one [BM, BD] array in a program of 4 warps: 32 a thread. The gated form holds
# three such arrays (x, z, the output) and the weights, which fit a thread's registers.
TILE_ELEMENTS = 4096
# Warps for a row wider than TILE_ELEMENTS grow with it, to this many (rows up to 16384 wide
# keep 32 values a thread).
MAX_WARPS = 16


def block(dim: int) -> tuple[int, int, int]:
    """(rows, padded width, warps) of one program for rows of width `dim`: a narrow row shares
    a program with others, a wide one has it alone and more warps."""
    bd = triton.next_power_of_2(dim)
    rows = max(1, TILE_ELEMENTS // bd)
    return rows, bd, min(MAX_WARPS, 4 * max(1, bd // TILE_ELEMENTS))


# The row count must not compile a kernel of its own (1 would).
@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_kernel(
    x_ptr,
    z_ptr,
    w_ptr,
    o_ptr,
    n_rows,
    dim,
    eps,
    GATED: tl.constexpr,
    BM: tl.constexpr,
    BD: tl.constexpr,
):
    o_m = tl.program_id(0) * BM + tl.arange(0, BM)
    o_d = tl.arange(0, BD)
    m_m, m_d = o_m < n_rows, o_d < dim
    mask = m_m[:, None] & m_d[None, :]
    p_x = o_m[:, None] * dim + o_d[None, :]
    b_x = tl.load(x_ptr + p_x, mask=mask, other=0.0).to(tl.float32)
    b_w = tl.load(w_ptr + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_inv = 1.0 / tl.sqrt(tl.sum(b_x * b_x, axis=1) / dim + eps)
    b_y = b_x * b_inv[:, None]
    if GATED:
        b_z = tl.load(z_ptr + p_x, mask=mask, other=0.0).to(tl.float32)
        b_y = b_w[None, :] * b_y * (b_z * tl.sigmoid(b_z))
    else:
        b_y = b_y * (1.0 + b_w[None, :])
    tl.store(o_ptr + p_x, b_y.to(o_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, z: torch.Tensor | None, w: torch.Tensor, eps: float) -> torch.Tensor:
    dim = x.shape[-1]
    x2 = x.reshape(-1, dim).contiguous()
    z2 = x2 if z is None else z.reshape(-1, dim).contiguous()
    out = torch.empty_like(x2)
    if x2.shape[0] == 0:
        return out.view(x.shape)
    bm, bd, warps = block(dim)
    _rms_norm_kernel[(triton.cdiv(x2.shape[0], bm),)](
        x2,
        z2,
        w.contiguous(),
        out,
        x2.shape[0],
        dim,
        eps,
        GATED=z is not None,
        BM=bm,
        BD=bd,
        num_warps=warps,
    )
    return out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., D], weight: [D] -> [..., D]"""
    if weight.shape != (x.shape[-1],):
        raise ValueError(
            f"rms_norm: weight of shape {tuple(weight.shape)} does not match "
            f"the last dim of x, {x.shape[-1]}"
        )
    return _launch(x, None, weight, eps)


def gated_rms_norm(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """x, z: [..., D], weight: [D] -> [..., D]"""
    if z.shape != x.shape:
        raise ValueError(f"gated_rms_norm: z has shape {tuple(z.shape)}, x {tuple(x.shape)}")
    if weight.shape != (x.shape[-1],):
        raise ValueError(
            f"gated_rms_norm: weight of shape {tuple(weight.shape)} does not "
            f"match the last dim of x, {x.shape[-1]}"
        )
    return _launch(x, z, weight, eps)
