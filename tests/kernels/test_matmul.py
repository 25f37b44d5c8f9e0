"""The batch-invariant GEMM (`kernels/matmul/triton.py`) against `kernels/matmul/naive.py`,
its row bytes against the row count at the default model's linear shapes, and its split of K
at Qwen3-Next-80B's."""

from __future__ import annotations

import pytest
import torch

from kernels.matmul import naive
from kernels.matmul import triton as kt
from tests.kernels.device import moved_rows, on

# fp32: the same products summed in another order; bf16/fp16: one rounding of the output
# after that, which moves a value by a unit in its last place.
TOL = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
# [K, N] of every linear of the default model (hidden 128): the MLP's, the attention's,
# the GDN projections', the MTP head's `fc` and the LM head.
SHAPES = [(128, 8), (128, 128), (128, 384), (128, 768), (128, 4096), (256, 128), (384, 128)]
# [K, N] of Qwen3-Next-80B's linears.
FLAGSHIP = [
    (2048, 12288),  # GDN in_proj_qkvz
    (2048, 64),  # GDN in_proj_ba
    (4096, 2048),  # GDN out_proj, attention o_proj, the MTP head's fc
    (2048, 9216),  # attention q (with its gate), k, v
    (2048, 512),  # router
    (2048, 1024),  # shared expert gate and up
    (512, 2048),  # shared expert down
    (2048, 1),  # shared expert gate
    (2048, 151936),  # LM head
]
BM = kt.TILES[torch.float32][0]
# Row counts of the invariance test: one row, odd counts, a full row tile (the last count
# whose splits run as programs of their own), one past it, two tiles.
COUNTS = [1, 2, 5, 17, 63, BM, BM + 1, BM + 36, 2 * BM]


# (M, K, N, TARGET_PROGRAMS or None for the module's): K split, the runs as programs of their
# own (M up to a row tile) or walked by one program (M = 70); K of one 16-bit block; a small
# target, for a few runs of several blocks, the last block partial.
PRODUCTS = {
    "M37-K128-N384": (37, 128, 384, None),
    "M37-K100-N70": (37, 100, 70, None),
    "M1-K256-N4096": (1, 256, 4096, None),
    "M70-K256-N384": (70, 256, 384, None),
    "M1-K64-N100": (1, 64, 100, None),
    "M5-K330-N70-T4": (5, 330, 70, 4),
    "M70-K330-N70-T4": (70, 330, 70, 4),
}
# (K, N, bias, TARGET_PROGRAMS or None): the default model's linears but the LM head, whose
# 32 column tiles add only time (20 s interpreted); then with a bias, and with few long runs.
BATCHES = {
    **{f"K{k}-N{n}": (k, n, False, None) for k, n in SHAPES if n < 4096},
    "K128-N384-bias": (128, 384, True, None),
    "K100-N70-bias": (100, 70, True, None),
    "K384-N128-T4": (384, 128, False, 4),
}


@pytest.mark.parametrize("dtype", list(TOL), ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize(("m", "k", "n", "target"), PRODUCTS.values(), ids=PRODUCTS)
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
def test_matches_naive(
    m: int,
    k: int,
    n: int,
    target: int | None,
    dtype: torch.dtype,
    bias: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if target is not None:
        monkeypatch.setattr(kt, "TARGET_PROGRAMS", target)
    gen = torch.Generator().manual_seed(m + k + n)
    x = (torch.randn(m, k, generator=gen) / k**0.5).to(dtype)
    w = torch.randn(k, n, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    got = kt.matmul(*on(x, w), *(on(b) if b is not None else [None])).cpu()
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), naive.matmul(x, w, b).float(), atol=tol, rtol=tol)
    assert (kt.plan(m, n, k, dtype).splits > 1) == (k > kt.TILES[dtype][2])


@pytest.mark.parametrize(("k", "n", "bias", "target"), BATCHES.values(), ids=BATCHES)
def test_row_bytes_do_not_depend_on_the_batch(
    k: int, n: int, bias: bool, target: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows 0..2BM-1 multiplied at once are the reference; then for each M in COUNTS, M of
    them moved (`moved_rows`), each output row against its reference row, byte for byte."""
    if target is not None:
        monkeypatch.setattr(kt, "TARGET_PROGRAMS", target)
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(2 * BM, k, generator=gen)
    (w,) = on(torch.randn(k, n, generator=gen) / k**0.5)
    b = on(torch.randn(n, generator=gen))[0] if bias else None
    (xs,) = on(x)
    ref = kt.matmul(xs, w, b)
    for m in COUNTS:
        rows = moved_rows(m, BM)
        assert torch.equal(kt.matmul(xs[rows], w, b), ref[rows]), f"M={m}"


@pytest.mark.parametrize(("k", "n"), FLAGSHIP, ids=str)
def test_split_of_k(k: int, n: int) -> None:
    """The split is the same at every M, every split has a BK block and the last ends at K,
    and one row makes TARGET_PROGRAMS programs unless K has too few blocks for it."""
    bk = kt.TILES[torch.bfloat16][2]
    p = kt.plan(1, n, k)
    assert {(kt.plan(m, n, k).splits, kt.plan(m, n, k).split_blocks) for m in COUNTS} == {
        (p.splits, p.split_blocks)
    }
    assert (p.splits - 1) * p.split_blocks < -(-k // bk) <= p.splits * p.split_blocks
    assert p.programs >= min(kt.TARGET_PROGRAMS, p.tiles * -(-k // bk))


def test_bad_shapes_and_dtypes_are_refused() -> None:
    with pytest.raises(ValueError, match="do not multiply"):
        kt.matmul(*on(torch.randn(2, 8), torch.randn(7, 4)))
    with pytest.raises(ValueError, match="must be one of"):
        kt.matmul(*on(torch.randn(2, 8), torch.randn(8, 4).double()))
    with pytest.raises(ValueError, match="bias"):
        kt.matmul(*on(torch.randn(2, 8), torch.randn(8, 4), torch.randn(3)))
