"""Triton RMSNorm and gated RMSNorm against `kernels/rmsnorm/naive.py`."""

from __future__ import annotations

import pytest
import torch

from kernels.rmsnorm import naive
from kernels.rmsnorm import triton as kt
from tests.kernels.device import on

# fp32: same math, the sum's order differs; bf16: one rounding of the output.
TOL = {torch.float32: 2e-6, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("rows", "dim"), [(1, 16), (17, 100), (40, 256)], ids=["R1-D16", "R17-D100", "R40-D256"]
)
def test_rms_norms(rows: int, dim: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows + dim)
    x, z = (torch.randn(rows, dim, generator=gen).to(dtype) for _ in range(2))
    w = torch.randn(dim, generator=gen).to(dtype)
    torch.testing.assert_close(
        kt.rms_norm(*on(x, w), 1e-6).cpu(),
        naive.rms_norm(x, w, 1e-6),
        atol=TOL[dtype],
        rtol=TOL[dtype],
    )
    torch.testing.assert_close(
        kt.gated_rms_norm(*on(x, z, w), 1e-6).cpu(),
        naive.gated_rms_norm(x, z, w, 1e-6),
        atol=TOL[dtype],
        rtol=TOL[dtype],
    )


def test_bad_weight_is_refused() -> None:
    with pytest.raises(ValueError, match="weight"):
        kt.rms_norm(*on(torch.randn(2, 8), torch.randn(7)), 1e-6)
