"""Helpers that make the plain-torch references batch invariant, byte for byte.

A CPU pointwise kernel runs its vector body over whole vectors and a scalar loop over the
tail, and the two round transcendental functions (sigmoid, silu, softplus) differently in the
last bit. Which elements land in the tail depends on the tensor's size, so a row's result
would depend on how many rows share the call. `pointwise` runs the function over a copy
padded to a size that leaves no tail on any split the thread pool makes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Two AVX-512 float vectors, the widest step of the vector body.
_VECTOR_STEP = 32


def pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`fn(x)` for an elementwise `fn`, with every element taking the vector path. A strided
    view (a column slice) is not flattened: the loop then runs row by row, each row with the
    same body and tail whatever the number of rows, so it needs no padding."""
    if not x.is_contiguous() and x.stride(-1) == 1:
        return fn(x)
    flat = x.reshape(-1)
    step = _VECTOR_STEP * max(1, torch.get_num_threads())
    pad = (-flat.numel()) % step
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    else:
        flat = flat.contiguous()
    return fn(flat)[: x.numel()].view(x.shape)


def silu(x: torch.Tensor) -> torch.Tensor:
    return pointwise(torch.nn.functional.silu, x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return pointwise(torch.sigmoid, x)


def softplus(x: torch.Tensor) -> torch.Tensor:
    return pointwise(torch.nn.functional.softplus, x)


def exp(x: torch.Tensor) -> torch.Tensor:
    return pointwise(torch.exp, x)


def rms_scaled(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim; sqrt and division round exactly on every
    path, unlike rsqrt. x: [..., D] -> [..., D]"""
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
