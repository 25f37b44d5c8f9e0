"""Block-scaled FP8: the torch reference (`kernels/fp8/naive.py`) against plain fp32 math, and
the Triton GEMM (`kernels/fp8/triton.py`) against the reference: its activation bytes, its
products, its row bytes against the row count, its split of K, and what it refuses."""

from __future__ import annotations

import pytest
import torch

from kernels.common import pad_rows
from kernels.fp8 import naive
from kernels.fp8 import triton as kt
from kernels.fp8.naive import BLOCK, FP8, FP8_MAX, BlockFp8
from tests.kernels.device import DEVICE, moved_rows, on

BM = kt.TILE[0]
# Half e4m3's spacing, relative to a normal value (3 mantissa bits); in the subnormal range
# (below 2^-6 of the scale) half its step, 2^-10 of the scale.
HALF_STEP = 2.0**-4
HALF_SUBNORMAL_STEP = 2.0**-10
# The Triton GEMM against naive, for outputs of order 1 (absolute and relative). Both quantize
# x to the same bytes and multiply the same FP8 values, so under the interpreter they differ by
# the order of a block's fp32 sum alone, as the bf16 GEMM's fp32 products do; bf16 and fp16
# outputs then by a unit in the last place of the cast. On a GPU the FP8 tensor cores add a
# block's 128 products in an accumulator narrower than fp32 (about 14 bits on Hopper, by
# DeepSeek-V3's measure) before the kernel adds the block to its fp32 sum.
TOL = {
    "cpu": {torch.float32: 2e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3},
    "cuda": {torch.float32: 1e-2, torch.bfloat16: 2e-2, torch.float16: 1e-2},
}[DEVICE.type]


def _runs(n: int, lengths: list[int], g: int) -> torch.Tensor:
    """Output columns' scale columns as runs of the given lengths cycling over G columns out of
    order (a regrouped layout: runs not aligned to 128, a column group used twice), [n] int32."""
    cols = []
    for i, length in enumerate(lengths * n):
        cols += [(3 * i + 1) % g] * length
        if len(cols) >= n:
            break
    return torch.tensor(cols[:n], dtype=torch.int32)


def _weight(k: int, n: int, g: int | None, gen: torch.Generator) -> BlockFp8:
    """A [K, N] BlockFp8 of random e4m3 values. g None: the published grid, a checkpoint's
    blocks (`groups` = n // 128); else a grid of g columns cut into runs of odd lengths, with
    scales far apart (2^-6 .. 2^0) so that a column reading another's scale shows."""
    if g is None:
        q, scale_inv = naive.quantize_blocks(torch.randn(n, k, generator=gen))
        groups = torch.arange(n, dtype=torch.int32) // BLOCK
        return BlockFp8(q.t().contiguous(), scale_inv.t().contiguous(), groups)
    q = (torch.randn(k, n, generator=gen) * 64).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    scales = 2.0 ** -torch.randint(0, 7, (naive.blocks(k), g), generator=gen).float() / 64
    return BlockFp8(q, scales, _runs(n, [37, 70, 5, 101], g))


def _on(w: BlockFp8) -> BlockFp8:
    return BlockFp8(*on(*w))


def _bytes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


# -- the reference ---------------------------------------------------------------------------


def test_quantize_blocks_round_trip() -> None:
    """Every weight comes back within half an e4m3 step of its block's scale grid, each block's
    largest magnitude maps to +-448, and a block of zeros keeps a finite scale and its zeros."""
    gen = torch.Generator().manual_seed(0)
    out, inp = 300, 200  # neither a multiple of 128
    w = torch.randn(out, inp, generator=gen) * torch.logspace(-3, 2, inp)  # block scales apart
    w[:128, 128:] = 0.0
    q, scale_inv = naive.quantize_blocks(w)
    assert q.dtype == FP8 and q.shape == w.shape
    assert scale_inv.shape == (3, 2) and scale_inv.dtype == torch.float32
    back = naive.dequantize_blocks(q, scale_inv)
    scale = scale_inv.repeat_interleave(BLOCK, 0)[:out].repeat_interleave(BLOCK, 1)[:, :inp]
    bound = torch.maximum(w.abs() * HALF_STEP, scale * HALF_SUBNORMAL_STEP) * (1 + 1e-6)
    assert ((back - w).abs() <= bound).all()
    padded = torch.nn.functional.pad(q.float().abs(), (0, 2 * BLOCK - inp, 0, 3 * BLOCK - out))
    amax = padded.view(3, BLOCK, 2, BLOCK).amax((1, 3))
    assert torch.equal(amax, torch.tensor([[FP8_MAX, 0.0], [FP8_MAX, FP8_MAX], [FP8_MAX] * 2]))
    assert torch.isfinite(scale_inv).all() and (back[:128, 128:] == 0).all()


def test_fp8_linear_within_fp8_of_the_dequantized_product() -> None:
    """fp8_linear against x @ dequantize(w) in fp32: each output within the error that
    quantizing x allows, half an e4m3 step of each x (or of its scale, below 2^-6 of it) times
    |w|, plus fp32's rounding."""
    gen = torch.Generator().manual_seed(1)
    for g in (None, 3):
        w = _weight(300, 200, g, gen)
        x = torch.randn(9, 300, generator=gen) * torch.logspace(-2, 1, 300)
        dense = naive.dequantize(w)
        got = naive.fp8_linear(x, w)
        _, sx = naive.quantize_rows(x)
        sx_cols = sx.repeat_interleave(BLOCK, 1)[:, :300]
        slack = x.abs() @ dense.abs()
        bound = HALF_STEP * slack + HALF_SUBNORMAL_STEP * (sx_cols @ dense.abs()) + 1e-5 * slack
        err = (got - x @ dense).abs()
        assert (err <= bound).all(), (err / bound).max()
        assert err.max() > 0  # x was quantized: the comparison is not of a product with itself


def test_fp8_linear_rows_do_not_depend_on_the_batch() -> None:
    """Rows padded to a multiple of ROW_TILE, as the engine carries them: each row's bytes the
    same alone, among a few others and in the whole batch, wherever it sits."""
    gen = torch.Generator().manual_seed(2)
    w = _weight(300, 520, None, gen)
    x = torch.randn(16, 300, generator=gen)
    full = naive.fp8_linear(x, w)
    for m, start in ((1, 0), (1, 7), (3, 5), (5, 11), (8, 4), (13, 1)):
        part = naive.fp8_linear(pad_rows(x[start : start + m]), w)[:m]
        assert torch.equal(part, full[start : start + m]), (m, start)


# -- the Triton GEMM ---------------------------------------------------------------------------


def _adversarial_rows(rows: int, k: int) -> torch.Tensor:
    """Rows whose every 128-column group holds 448 (scale 1, so x / scale is x) beside values
    where e4m3 rounding is decided, of both signs, at random places: each e4m3 magnitude, the
    ties between neighbours (to even), a fp32 step either side of the ties, subnormals and
    their ties, values that round to (-)0, and -0 itself."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(FP8).float()  # every finite magnitude
    ties = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([ties.nextafter(torch.tensor(0.0)), ties.nextafter(torch.tensor(1e9))])
    tiny = torch.tensor([2.0**-10, 3 * 2.0**-11, 2.0**-12, 1e-30, 0.0])
    values = torch.cat([grid, ties, near, tiny])
    values = torch.cat([values, -values, torch.tensor([-0.0])])
    gen = torch.Generator().manual_seed(rows)
    pick = torch.randint(0, values.numel(), (rows, k), generator=gen)
    x = values[pick]
    x[:, ::BLOCK] = FP8_MAX
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_activation_bytes_are_naives(dtype: torch.dtype) -> None:
    """The quantizing kernel (the GEMM's past one row tile) writes naive's bytes and scales:
    rows of the decisive values, and random rows of scales far apart, K not a multiple of 128."""
    gen = torch.Generator().manual_seed(3)
    k = 330
    spread = torch.randn(70, k, generator=gen) * 10.0 ** torch.randint(
        -6, 4, (70, 1), generator=gen
    )
    for x in (_adversarial_rows(70, k).to(dtype), spread.to(dtype)):
        xq, sx = kt.quantize_rows(x.to(DEVICE))
        ref_q, ref_s = naive.quantize_rows(x)
        assert xq.dtype == FP8 and sx.shape == ref_s.shape
        assert torch.equal(_bytes(xq).cpu(), _bytes(ref_q))
        assert torch.equal(sx.cpu(), ref_s)


@pytest.mark.parametrize("m", [5, BM + 6], ids=["fused", "quantized-first"])
def test_each_output_one_product_is_naives_bytes(m: int) -> None:
    """A weight with one nonzero per column makes every output a single product, which both
    compute exactly, one rounding per multiplication in the same order: the GEMM's output is
    naive's byte for byte, so the activation bytes it multiplies (quantized inside the GEMM
    while the rows fit one tile, by the quantizing kernel past it) are naive's too."""
    k = n = 256
    gen = torch.Generator().manual_seed(4)
    x = _adversarial_rows(m, k) * 10.0 ** torch.randint(-3, 3, (m, 1), generator=gen)
    rows = torch.randperm(k, generator=gen)
    q = torch.zeros(k, n)
    q[rows, torch.arange(n)] = torch.randn(n, generator=gen).clamp(-4, 4)
    groups = (torch.arange(n) // BLOCK).int()
    w = BlockFp8(q.to(FP8), torch.rand(2, 2, generator=gen) + 0.5, groups)
    got = kt.fp8_matmul(x.to(DEVICE), _on(w)).cpu()
    assert torch.equal(got, naive.fp8_linear(x, w))


# (M, K, N, G or None for the published grid, TARGET_PROGRAMS or None for the module's): one
# row, split programs; K and N ragged with cut runs of scale columns, quantized in the GEMM
# then first; runs of several blocks (a small target), the last one partial.
PRODUCTS = {
    "M1-K256-N256": (1, 256, 256, None, None),
    "M5-K300-N200-cut": (5, 300, 200, 5, None),
    "M70-K300-N200-cut": (70, 300, 200, 5, None),
    "M5-K640-N130-T4": (5, 640, 130, 3, 4),
    "M70-K640-N130-T4": (70, 640, 130, 3, 4),
}


def _compare(
    m: int, k: int, n: int, g: int | None, dtype: torch.dtype, out_dtype: torch.dtype | None
) -> None:
    gen = torch.Generator().manual_seed(m + k + n)
    w = _weight(k, n, g, gen)
    # Outputs of order 1: x's columns weigh 1 / sqrt(K) of a unit of w.
    unit = naive.dequantize(w).abs().mean()
    x = (torch.randn(m, k, generator=gen) / (k**0.5 * unit)).to(dtype)
    got = kt.fp8_matmul(x.to(DEVICE), _on(w), out_dtype).cpu()
    ref = naive.fp8_linear(x, w, out_dtype)
    assert got.dtype == ref.dtype == (out_dtype or dtype)
    tol = TOL[ref.dtype]
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize(("m", "k", "n", "g", "target"), PRODUCTS.values(), ids=PRODUCTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_naive(
    m: int,
    k: int,
    n: int,
    g: int | None,
    target: int | None,
    dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if target is not None:
        monkeypatch.setattr(kt, "TARGET_PROGRAMS", target)
    _compare(m, k, n, g, dtype, None)
    p = kt.plan(m, n, k)
    assert p.fused == (m <= BM) and (p.splits > 1) == (k > BLOCK)


@pytest.mark.parametrize(
    ("dtype", "out_dtype"),
    [(torch.float16, None), (torch.bfloat16, torch.float32), (torch.float32, torch.float16)],
    ids=["fp16", "bf16-to-fp32", "fp32-to-fp16"],
)
def test_other_dtypes(dtype: torch.dtype, out_dtype: torch.dtype | None) -> None:
    _compare(3, 200, 130, 2, dtype, out_dtype)


def test_row_bytes_do_not_depend_on_the_batch() -> None:
    """Rows 0..2BM-1 multiplied at once are the reference (quantized first, each program
    walking its splits); then M of them moved (`moved_rows`), for M from one row (quantized in
    the GEMM, the splits programs of their own) to past a row tile, each output row against
    its reference row, byte for byte."""
    gen = torch.Generator().manual_seed(6)
    w = _on(_weight(256, 256, 3, gen))
    (xs,) = on((torch.randn(2 * BM, 256, generator=gen) / 16).bfloat16())
    ref = kt.fp8_matmul(xs, w, torch.float32)
    assert kt.plan(2 * BM, 256, 256).splits > 1
    for m in (1, 5, BM, BM + 1, BM + 6):
        rows = moved_rows(m, BM)
        assert torch.equal(kt.fp8_matmul(xs[rows], w, torch.float32), ref[rows]), f"M={m}"


# [K, N] of the flagship's linears that its FP8 checkpoint quantizes.
FLAGSHIP = [(2048, 12288), (4096, 2048), (2048, 9216), (2048, 1024), (512, 2048)]


@pytest.mark.parametrize(("k", "n"), FLAGSHIP, ids=str)
def test_split_of_k(k: int, n: int) -> None:
    """The split is the same at every M, every split has a block and the last ends at K, and
    one row makes TARGET_PROGRAMS programs unless K has too few blocks for it."""
    p = kt.plan(1, n, k)
    assert {
        (kt.plan(m, n, k).splits, kt.plan(m, n, k).split_blocks) for m in (1, 8, 64, 65, 4096)
    } == {(p.splits, p.split_blocks)}
    assert (p.splits - 1) * p.split_blocks < -(-k // BLOCK) <= p.splits * p.split_blocks
    assert p.programs >= min(kt.TARGET_PROGRAMS, p.tiles * -(-k // BLOCK))


def test_bad_inputs_are_refused() -> None:
    gen = torch.Generator().manual_seed(7)
    w = _weight(256, 130, None, gen)
    x = torch.randn(2, 256)
    cases = {
        "x must be .* not \\[2, 1, 256\\]": (torch.randn(2, 1, 256), w, None),
        "x must be .* torch.float64": (x.double(), w, None),
        "do not multiply": (torch.randn(2, 255), w, None),
        "weight is torch.bfloat16": (x, w._replace(weight=w.weight.bfloat16()), None),
        "scales": (x, w._replace(scales=w.scales[:1]), None),
        "scales .* fp32": (x, w._replace(scales=w.scales.double()), None),
        "groups": (x, w._replace(groups=w.groups.long()), None),
        "groups \\[129\\]": (x, w._replace(groups=w.groups[:129]), None),
        "out_dtype": (x, w, torch.int32),
        "on \\['cpu', 'meta'\\]": (x.to("meta"), w, None),
    }
    for match, (xx, ww, out) in cases.items():
        with pytest.raises(ValueError, match=match):
            kt.fp8_matmul(xx, ww, out)
    with pytest.raises(ValueError, match="quantize_rows: x"):
        kt.quantize_rows(torch.randn(2, 3, 4))


def test_what_the_dot_multiplies() -> None:
    """e4m3 on sm_89 and later and on `meta` (compiled for sm_90 and sm_100 by tools.kernel_report),
    fp16 before (sm_80), fp32 in the interpreter."""
    assert [kt.dot_for(c) for c in ((8, 0), (8, 6), (8, 9), (9, 0), (10, 0))] == [
        "fp16",
        "fp16",
        "fp8",
        "fp8",
        "fp8",
    ]
    assert kt.dot_of(torch.empty(0, device="meta")) == "fp8"
    assert kt.dot_of(torch.empty(0)) == "fp32"


def test_fp8_upcast_is_exact() -> None:
    """The CPU's upcast of FP8 weights by their bits: every finite e4m3 value, signed zeros
    and subnormals included, as torch converts it."""
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(naive.FP8)
    want = every.float()
    finite = want.isfinite()
    got = naive.upcast(every)
    assert torch.equal(got[finite], want[finite])
    assert torch.equal(got[finite].signbit(), want[finite].signbit())
