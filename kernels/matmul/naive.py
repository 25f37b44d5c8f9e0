"""`x @ W^T + bias` with the weight stored transposed (`[K, N]`, contiguous, as the engine
keeps every linear), accumulated in fp32 and returned in x's dtype: the reference of the
batch-invariant Triton GEMM beside it."""

from __future__ import annotations

import torch


def matmul(
    x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x: [M, K], weight_t: [K, N], bias: [N] or None -> [M, N] in x's dtype"""
    out = x.float() @ weight_t.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
