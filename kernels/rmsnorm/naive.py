"""RMSNorm as Qwen3-Next has it: zero-centred `(1 + w) * rmsnorm(x)`, and the gated form of the
GDN output `w * rmsnorm(x) * silu(z)` (w starts at 1). Computed in fp32, returned in x's dtype."""

from __future__ import annotations

import torch

from kernels.common import rms_scaled, silu


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., D], weight: [D]"""
    xf = x.float()
    return (rms_scaled(xf, eps) * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """x, z: [..., D], weight: [D]"""
    xf = x.float()
    normed = (rms_scaled(xf, eps) * weight.float()).to(x.dtype)
    return (normed.float() * silu(z.float())).to(x.dtype)
