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

# Rows of every per-row tensor are carried padded to a multiple of this: the CPU GEMM with an
# `[in, out]` weight then gives a row the same bytes at any row count (gpu_service/model/ops.py).
ROW_TILE = 4


def interpreted(x: torch.Tensor) -> bool:
    """Whether a kernel given `x` runs in Triton's interpreter: on CPU tensors. A GPU's tensors
    (and `meta` ones, which tools.kernel_report compiles for a GPU) take the compiled path, where a
    low-precision `tl.dot` is exact; the interpreter's is not, so kernels upcast there first."""
    return x.device.type == "cpu"


def padded_rows(rows: int, tile: int = ROW_TILE) -> int:
    return -(-rows // tile) * tile


def pad_rows(x: torch.Tensor, tile: int = ROW_TILE) -> torch.Tensor:
    """x: [R, ...] -> [P, ...] with zero rows appended, P a multiple of `tile`."""
    extra = padded_rows(x.shape[0], tile) - x.shape[0]
    if extra == 0:
        return x
    return torch.cat([x, x.new_zeros(extra, *x.shape[1:])])


# Two AVX-512 float vectors, the widest step of the vector body.
_VECTOR_STEP = 32


def pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`fn(x)` for an elementwise `fn`, with every element taking the vector path. A strided
    view (a column slice) is not flattened: the loop then runs row by row, each row with the
    same body and tail whatever the number of rows, so it needs no padding."""
    if torch.compiler.is_compiling() or (not x.is_contiguous() and x.stride(-1) == 1):
        return fn(x)
    flat = x.reshape(-1)
    step = _VECTOR_STEP * max(1, torch.get_num_threads())
    pad = (-flat.numel()) % step
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    else:
        flat = flat.contiguous()
    return fn(flat)[: x.numel()].view(x.shape)


# A chunk's decays are exps of sums of log-decays over up to a chunk of rows, which reach far
# below exp(-87), where fp32 turns subnormal; the CPU computes and multiplies subnormals tens
# of times slower. A decay that small weighs nothing next to the others, so it is floored at
# exp(-60), which also keeps the products that follow clear of subnormals.
DECAY_FLOOR = -60.0


def decay_exp(x: torch.Tensor) -> torch.Tensor:
    """exp(x) for a log-decay x <= 0, never below exp(DECAY_FLOOR) (about 8.8e-27). An x above
    0 (a chunk's pairwise decays above the diagonal, which the caller masks) reads as 0: exp
    overflowing there is as slow as underflowing."""
    return torch.exp(x.clamp(DECAY_FLOOR, 0.0))


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
