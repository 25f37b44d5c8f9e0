"""Triton RMSNorm and gated RMSNorm against `kernels/rmsnorm/naive.py`, and their row bytes
against the row count."""

from __future__ import annotations

import pytest
import torch

from kernels.rmsnorm import naive
from kernels.rmsnorm import triton as kt
from tests.kernels.device import moved_rows, on

# fp32: same math, the sum's order differs; bf16: one rounding of the output.
TOL = {torch.float32: 2e-6, torch.bfloat16: 1e-2}
# (rows, width): one row, odd widths, the default model's head and hidden widths, and
# Qwen3-Next-80B's hidden width and a wider one, where a program holds fewer rows.
SHAPES = {
    "R1-D16": (1, 16),
    "R17-D100": (17, 100),
    "R40-D256": (40, 256),
    "R3-D2048": (3, 2048),
    "R2-D5120": (2, 5120),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("rows", "dim"), SHAPES.values(), ids=SHAPES)
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


@pytest.mark.parametrize("dim", [32, 100, 2048, 5120], ids=lambda d: f"D{d}")
def test_row_bytes_do_not_depend_on_the_batch(dim: int) -> None:
    """Two programs' rows normed at once are the reference; then from one row to all of
    them, moved (`moved_rows`), each row against its reference, byte for byte."""
    bm = kt.block(dim)[0]
    gen = torch.Generator().manual_seed(dim)
    x, z = on(*(torch.randn(2 * bm, dim, generator=gen) for _ in range(2)))
    (w,) = on(torch.randn(dim, generator=gen))
    ref = kt.rms_norm(x, w, 1e-6), kt.gated_rms_norm(x, z, w, 1e-6)
    for m in sorted({1, max(1, bm // 2 + 1), bm, bm + 1, 2 * bm}):
        rows = moved_rows(m, bm)
        assert torch.equal(kt.rms_norm(x[rows], w, 1e-6), ref[0][rows]), f"M={m}"
        got = kt.gated_rms_norm(x[rows], z[rows], w, 1e-6)
        assert torch.equal(got, ref[1][rows]), f"gated M={m}"


def test_bad_weight_is_refused() -> None:
    with pytest.raises(ValueError, match="weight"):
        kt.rms_norm(*on(torch.randn(2, 8), torch.randn(7)), 1e-6)
