"""RMSNorm (zero-centred, `(1 + w) * rmsnorm(x)`) and the gated form of the GDN output
(`w * rmsnorm(x) * silu(z)`), one program per block of rows, fp32 inside."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS = 16


@triton.jit
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
    rows = x2.shape[0]
    grid = (triton.cdiv(rows, ROWS),)
    _rms_norm_kernel[grid](
        x2,
        z2,
        w.contiguous(),
        out,
        rows,
        dim,
        eps,
        GATED=z is not None,
        BM=ROWS,
        BD=triton.next_power_of_2(dim),
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
