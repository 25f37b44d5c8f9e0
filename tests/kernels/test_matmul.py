"""The batch-invariant GEMM (`kernels/matmul/triton.py`) against `kernels/matmul/naive.py`,
and its row bytes against the row count and the row's position, at the default model's
linear shapes."""

from __future__ import annotations

import pytest
import torch

from kernels.matmul import naive
from kernels.matmul import triton as kt
from tests.kernels.device import on

# fp32: the same products summed in another order; bf16/fp16: one rounding of the output
# after that, which moves a value by a unit in its last place.
TOL = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
# [K, N] of every linear of the default model (hidden 128): the MLP's, the attention's,
# the GDN projections', the MTP head's `fc` and the LM head.
SHAPES = [(128, 8), (128, 128), (128, 384), (128, 768), (128, 4096), (256, 128), (384, 128)]
ROWS = 64


@pytest.mark.parametrize("dtype", list(TOL), ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize(("k", "n"), [(128, 384), (100, 70), (256, 4096)], ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
def test_matches_naive(k: int, n: int, dtype: torch.dtype, bias: bool) -> None:
    gen = torch.Generator().manual_seed(k + n)
    x = (torch.randn(37, k, generator=gen) / k**0.5).to(dtype)
    w = torch.randn(k, n, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    got = kt.matmul(*on(x, w), *(on(b) if b is not None else [None])).cpu()
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), naive.matmul(x, w, b).float(), atol=tol, rtol=tol)


@pytest.mark.parametrize(("k", "n"), SHAPES, ids=str)
def test_row_bytes_do_not_depend_on_the_batch(k: int, n: int) -> None:
    """Rows 0..63 multiplied at once are the reference; then for every M from 1 to 64 a
    rotation of them (so that rows move across positions and tiles), each output row against
    its reference row, byte for byte."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(ROWS, k, generator=gen)
    (w,) = on(torch.randn(k, n, generator=gen) / k**0.5)
    (xs,) = on(x)
    ref = kt.matmul(xs, w)
    for m in range(1, ROWS + 1):
        rows = (torch.arange(m) + 7 * m) % ROWS
        got = kt.matmul(xs[rows.to(xs.device)], w)
        assert torch.equal(got, ref[rows.to(xs.device)]), f"M={m}"


def test_bad_shapes_and_dtypes_are_refused() -> None:
    with pytest.raises(ValueError, match="do not multiply"):
        kt.matmul(*on(torch.randn(2, 8), torch.randn(7, 4)))
    with pytest.raises(ValueError, match="must be one of"):
        kt.matmul(*on(torch.randn(2, 8), torch.randn(8, 4).double()))
    with pytest.raises(ValueError, match="bias"):
        kt.matmul(*on(torch.randn(2, 8), torch.randn(8, 4), torch.randn(3)))
