"""The fused MoE kernels (`kernels/moe/triton.py`) against `kernels/moe/naive.py`, a row's bytes
against the batch it shares, the alignment of the pairs into expert blocks, and the refusals;
each with block-FP8 expert weights too."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8.naive import BLOCK, BlockFp8, fp8_linear, quantize_blocks
from kernels.moe import naive
from kernels.moe import triton as kt
from tests.kernels.device import DEVICE, on

# fp32: the same products summed in another order. bf16: the kernels round where the reference
# rounds, so only that order differs, and it can move a rounded value (gate, up, an expert's
# output) by one unit in its last place, 2^-8 relative, which the next steps carry on: a few
# units at most. Most elements come out equal byte for byte.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}
DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16"}
# (P, H, I, E, k, hot): `hot` biases the last expert's logit so that every row picks it. The
# shapes are odd on purpose; H 160 and I 80 take two K steps and two N tiles of the kernels, and
# E 16 at four rows of k 2 leaves at least half the experts unhit.
CASES = [
    (4, 32, 16, 3, 1, False),
    (4, 48, 24, 16, 2, True),
    (8, 96, 48, 8, 2, False),
    (12, 64, 40, 16, 4, True),
    (8, 160, 80, 6, 3, False),
    (12, 40, 16, 3, 1, True),
]


def case_id(case: tuple[int, int, int, int, int, bool]) -> str:
    rows, hidden, inner, num_experts, top_k, hot = case
    return f"P{rows}-H{hidden}-I{inner}-E{num_experts}-k{top_k}" + ("-hot" if hot else "")


def make_moe(
    case: tuple[int, int, int, int, int, bool], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> x [P, H], w13 [E, H, 2I], w2 [E, I, H], experts [P, k], weights [P, k], on the CPU"""
    rows, hidden, inner, num_experts, top_k, hot = case
    gen = torch.Generator().manual_seed(rows * hidden + num_experts)
    x = torch.randn(rows, hidden, generator=gen)
    w13 = torch.randn(num_experts, hidden, 2 * inner, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, inner, hidden, generator=gen) / inner**0.5
    logits = torch.randn(rows, num_experts, generator=gen)
    if hot:
        logits[:, -1] += 20.0
    weights, experts = naive.route(logits, top_k, renormalize=True)
    return x.to(dtype), w13.to(dtype), w2.to(dtype), experts, weights.to(dtype)


def fp8_experts(w: torch.Tensor, parts: int) -> BlockFp8:
    """w: [E, K, N] fp32 made of `parts` linears side by side (w13: gate and up) -> each part
    quantized as a checkpoint holds it (`[out, in]`, 128 x 128 blocks), in the engine's layout:
    a part's scale columns follow the one before's, as the packing lays them."""
    size = w.shape[2] // parts
    weights: list[torch.Tensor] = []
    scales: list[torch.Tensor] = []
    groups: list[torch.Tensor] = []
    for p in range(parts):
        quantized = [quantize_blocks(e[:, p * size : (p + 1) * size].T) for e in w.float()]
        weights.append(torch.stack([q.T for q, _ in quantized]))
        groups.append(sum(s.shape[2] for s in scales) + torch.arange(size) // BLOCK)
        scales.append(torch.stack([s.T for _, s in quantized]))
    return BlockFp8(
        torch.cat(weights, 2).contiguous(),
        torch.cat(scales, 2).contiguous(),
        torch.cat(groups).to(torch.int32),
    )


# x, w13, w2, experts, weights
Moe = tuple[torch.Tensor, naive.Experts, naive.Experts, torch.Tensor, torch.Tensor]


def make_fp8_moe(
    case: tuple[int, int, int, int, int, bool], dtype: torch.dtype
) -> tuple[torch.Tensor, BlockFp8, BlockFp8, torch.Tensor, torch.Tensor]:
    """`make_moe`'s with both expert stacks in block FP8, and x's groups of 128 columns each led
    by its greatest value, 448 times a power of two, the others multiples of 1/16 of it: its
    quantized values then fall on many halfway points, which must round to even."""
    x, w13, w2, experts, weights = make_moe(case, dtype)
    gen = torch.Generator().manual_seed(x.shape[0])
    scale = 2.0 ** torch.randint(-10, -3, (x.shape[0], 1), generator=gen)
    x = torch.randint(-448 * 16, 448 * 16, x.shape, generator=gen) / 16 * scale
    x[:, ::BLOCK] = 448 * scale
    return x.to(dtype), fp8_experts(w13, 2), fp8_experts(w2, 1), experts, weights


def on_moe(args: Moe) -> Moe:
    """The arguments on DEVICE, a block-FP8 stack's parts and all."""
    x, w13, w2, experts, weights = args
    w13, w2 = (BlockFp8(*on(*w)) if isinstance(w, BlockFp8) else on(w)[0] for w in (w13, w2))
    x, experts, weights = on(x, experts, weights)
    return x, w13, w2, experts, weights


@pytest.mark.parametrize("dtype", list(TOL), ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_naive(case: tuple[int, int, int, int, int, bool], dtype: torch.dtype) -> None:
    args = make_moe(case, dtype)
    got = kt.fused_moe(*on(*args)).cpu()
    want = naive.routed_moe(*args)
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    if dtype == torch.bfloat16:
        assert (got == want).float().mean() > 0.98, "the kernels do not round as naive.py does"


# Block-FP8 experts: H 160 takes two K blocks, the second short, and I 80 ends within a block,
# so gate and up each have a scale column of their own. The kernels quantize as the reference
# does, to the byte, so only the GEMMs' summation order differs: the same tolerances. A value
# quantized otherwise (a halfway point rounded away from even) moves its product by up to 1/16,
# far past the fp32 tolerance.
FP8_CASES = [(8, 160, 80, 6, 3, False), (12, 64, 40, 16, 4, True)]


@pytest.mark.parametrize("dtype", list(TOL), ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", FP8_CASES, ids=case_id)
def test_fp8_matches_naive(case: tuple[int, int, int, int, int, bool], dtype: torch.dtype) -> None:
    args = make_fp8_moe(case, dtype)
    got = kt.fused_moe(*on_moe(args)).cpu()
    want = naive.routed_moe(*args)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    if dtype == torch.bfloat16:
        assert (got == want).float().mean() > 0.98, "the kernels do not round as naive.py does"


def test_fp8_beside_plain_experts() -> None:
    """One stack in block FP8, the other plain: each GEMM takes its own kernel."""
    case = (4, 48, 24, 16, 2, True)
    x, w13, w2, experts, weights = make_fp8_moe(case, torch.bfloat16)
    _, plain13, plain2, _, _ = make_moe(case, torch.bfloat16)
    mixes: list[Moe] = [(x, plain13, w2, experts, weights), (x, w13, plain2, experts, weights)]
    for mixed in mixes:
        got = kt.fused_moe(*on_moe(mixed)).cpu()
        want = naive.routed_moe(*mixed)
        tol = TOL[torch.bfloat16]
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize(
    ("dtype", "fp8"),
    [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)],
    ids=["fp32", "bf16", "bf16-fp8"],
)
def test_row_bytes_do_not_depend_on_the_batch(dtype: torch.dtype, fp8: bool) -> None:
    """Each row of a 12-row batch run again in a smaller batch, byte for byte. On a GPU the row
    sits alone at one place of 4 rows whose others are zero rows routed elsewhere, so its pairs
    move within their blocks. Under the interpreter its pairs keep their places: the batch is
    the rows up to it (to the next four), the others zeroed but routed as before, because
    there `tl.dot` is numpy's BLAS, whose AVX2 kernels round a row by its place in the product
    (which says nothing of the kernel). With FP8 experts, three of the rows."""
    case = (12, 96, 40, 8, 3, False)
    args: Moe = make_fp8_moe(case, dtype) if fp8 else make_moe(case, dtype)
    x, w13, w2, experts, weights = on_moe(args)
    whole = kt.fused_moe(x, w13, w2, experts, weights)
    pad_experts = torch.tensor([[0, 1, 2]], device=x.device).expand(4, 3).clone()
    for row in range(1, 12, 5) if fp8 else range(12):
        if DEVICE.type == "cuda":
            at = row % 4
            xs, ex, ws = torch.zeros_like(x[:4]), pad_experts.clone(), torch.zeros_like(weights[:4])
            xs[at], ex[at], ws[at] = x[row], experts[row], weights[row]
        else:
            at, rows = row, -(-(row + 1) // 4) * 4  # the kernel takes rows in fours
            xs, ex, ws = torch.zeros_like(x[:rows]), experts[:rows], weights[:rows]
            xs[at] = x[row]
        alone = kt.fused_moe(xs, w13, w2, ex, ws)
        assert torch.equal(alone[at], whole[row]), f"row {row}"


@pytest.mark.parametrize(
    ("rows", "top_k", "num_experts", "block_m"),
    [(4, 1, 3, 16), (12, 4, 16, 16), (8, 2, 512, 16), (12, 3, 5, 4), (4, 2, 2, 1)],
    ids=["P4-k1-E3-BM16", "P12-k4-E16-BM16", "P8-k2-E512-BM16", "P12-k3-E5-BM4", "P4-k2-E2-BM1"],
)
def test_align_places_every_pair_once_in_blocks_of_one_expert(
    rows: int, top_k: int, num_experts: int, block_m: int
) -> None:
    gen = torch.Generator().manual_seed(rows * num_experts)
    experts = torch.rand(rows, num_experts, generator=gen).argsort(-1)[:, :top_k].sort(-1).values
    experts[: rows // 2, 0] = 0  # one expert taken by half the rows, and so padded over a block
    (dev_experts,) = on(experts)
    aligned = naive.align(dev_experts, num_experts, block_m)
    pairs, block_experts, num_used = (
        t.cpu() for t in (aligned.pairs, aligned.block_experts, aligned.num_used)
    )
    num_pairs = rows * top_k
    assert pairs.shape == (naive.padded_bound(num_pairs, num_experts, block_m),)
    assert block_experts.shape == (pairs.numel() // block_m,)
    used = int(num_used.item())
    flat = experts.reshape(-1)
    counts = torch.stack([(flat == e).sum() for e in range(num_experts)])
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum())
    real = pairs[pairs < num_pairs]
    assert torch.equal(real.sort().values, torch.arange(num_pairs))
    assert torch.equal(flat[real], flat.sort(stable=True).values)  # by expert
    assert torch.equal(real, flat.sort(stable=True).indices)  # rows ascending within one
    assert (pairs[used:] == num_pairs).all()
    for block, expert in enumerate(block_experts[: used // block_m].tolist()):
        entries = pairs[block * block_m : (block + 1) * block_m]
        assert (flat[entries[entries < num_pairs]] == expert).all(), f"block {block}"
        assert entries[0] < num_pairs, f"block {block} is all padding"
    assert (block_experts[used // block_m :] == num_experts).all()


def test_bad_input_is_refused() -> None:
    x, w13, w2, experts, weights = make_moe((4, 32, 16, 3, 2, False), torch.float32)
    with pytest.raises(ValueError, match="multiple of 4"):
        kt.fused_moe(x[:3], w13, w2, experts[:3], weights[:3])
    with pytest.raises(ValueError, match="must be \\[E, H, 2I\\]"):
        kt.fused_moe(x, w13[:, :31], w2, experts, weights)
    with pytest.raises(ValueError, match="pair"):
        kt.fused_moe(x, w13, w2[:, :15], experts, weights)
    with pytest.raises(ValueError, match="both be \\[P, k\\]"):
        kt.fused_moe(x, w13, w2, experts, weights[:, :1])
    with pytest.raises(ValueError, match="share one dtype"):
        kt.fused_moe(x, w13.bfloat16(), w2, experts, weights)
    with pytest.raises(ValueError, match="share one dtype"):
        kt.fused_moe(x.double(), w13.double(), w2.double(), experts, weights.double())
    with pytest.raises(ValueError, match="int64"):
        kt.fused_moe(x, w13, w2, experts.int(), weights)
    with pytest.raises(ValueError, match="contiguous"):
        kt.fused_moe(x, w13, w2.transpose(1, 2).contiguous().transpose(1, 2), experts, weights)
    with pytest.raises(ValueError, match="different devices"):
        kt.fused_moe(x, w13, w2, experts.to("meta"), weights)


def test_grouped_mm_without_torchs_grouped_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch without `grouped_mm` (an older one on a GPU machine) loops a GEMM per expert hit:
    the same bytes, empty runs skipped."""
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(24, 32, generator=gen), torch.randn(5, 32, 16, generator=gen)
    ends = torch.tensor([4, 4, 12, 20, 24], dtype=torch.int32)
    expected = naive.grouped_mm(x, w, ends)
    monkeypatch.delattr(torch.nn.functional, "grouped_mm")
    assert torch.equal(naive.grouped_mm(x, w, ends), expected)
    assert torch.equal(expected[4:12], torch.mm(x[4:12], w[2]))


@pytest.mark.parametrize(
    ("call_bytes", "copy_bytes"),
    [(0, naive.COPY_BYTES), (1 << 30, naive.COPY_BYTES), (1 << 30, 1)],
    ids=["per-expert", "blocked", "blocked-one-copy-a-call"],
)
def test_cpu_paths_give_the_same_bytes(
    call_bytes: int, copy_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU's two ways to run the experts' GEMMs (a GEMM per expert hit, or batched GEMMs
    over copies of each block's weights, as many a call as `COPY_BYTES` holds), chosen by what a
    call costs: the dense sum's bytes either way, and each block's rows the bytes of `torch.mm`
    on them."""
    x, w13, w2, experts, weights = make_moe((12, 64, 40, 16, 4, True), torch.float32)
    monkeypatch.setattr(naive, "CALL_BYTES", call_bytes)
    monkeypatch.setattr(naive, "COPY_BYTES", copy_bytes)
    assert torch.equal(
        naive.routed_moe(x, w13, w2, experts, weights),
        naive.dense_moe(x, w13, w2, experts, weights),
    )
    blocks = torch.tensor([3, 3, 0, 15])
    rows = torch.randn(16, 64, generator=torch.Generator().manual_seed(5))
    got = naive.blocked_mm(rows, w13, blocks)
    for b, e in enumerate(blocks.tolist()):
        assert torch.equal(got[4 * b : 4 * b + 4], torch.mm(rows[4 * b : 4 * b + 4], w13[e]))


def test_fp8_cpu_paths_give_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same with block-FP8 experts (H 160: two K blocks, the second short): each way gives
    the dense sum's bytes, whose experts run `fp8_linear`, and each block's rows the bytes of
    `fp8_linear` on them."""
    x, w13, w2, experts, weights = make_fp8_moe((12, 160, 40, 8, 4, True), torch.float32)
    dense = naive.dense_moe(x, w13, w2, experts, weights)
    for call_bytes, copy_bytes in [
        (0, naive.COPY_BYTES),
        (1 << 30, naive.COPY_BYTES),
        (1 << 30, 1),
    ]:
        monkeypatch.setattr(naive, "CALL_BYTES", call_bytes)
        monkeypatch.setattr(naive, "COPY_BYTES", copy_bytes)
        routed = naive.routed_moe(x, w13, w2, experts, weights)
        assert torch.equal(routed, dense), (call_bytes, copy_bytes)
    blocks = torch.tensor([3, 3, 0, 7])
    rows = torch.randn(16, 160, generator=torch.Generator().manual_seed(5))
    got = naive.blocked_mm(rows, w13, blocks)
    for b, e in enumerate(blocks.tolist()):
        want = fp8_linear(rows[4 * b : 4 * b + 4], naive.expert_weight(w13, e))
        assert torch.equal(got[4 * b : 4 * b + 4], want), f"block {b}"


def test_fp8_off_the_cpu_every_batched_gemm_has_one_shape() -> None:
    """Off the CPU the FP8 blocks go through batched GEMMs of one shape, the last padded with
    zero rows (a GPU library may choose its kernel by the batch): the same bytes as the CPU's
    calls, here with three blocks a call for seven blocks."""
    _, w13, _, _, _ = make_fp8_moe((12, 160, 40, 8, 4, True), torch.float32)
    rows = torch.randn(28, 160, generator=torch.Generator().manual_seed(6))
    blocks = torch.tensor([3, 3, 0, 5, 7, 7, 1])
    tile = 4 * BLOCK * w13.shape[2]
    padded = naive._fp8_blocked_mm(rows, w13, blocks, 3 * tile, pad=True)
    assert torch.equal(padded, naive._fp8_blocked_mm(rows, w13, blocks, tile, pad=False))
    assert torch.equal(padded, naive.blocked_mm(rows, w13, blocks))


def test_fp8_routed_rows_do_not_depend_on_the_batch() -> None:
    """The eager forward's FP8 experts: each row of a batch again alone (padded to four rows
    with zero rows routed elsewhere), byte for byte."""
    x, w13, w2, experts, weights = make_fp8_moe((12, 160, 40, 8, 4, True), torch.bfloat16)
    whole = naive.routed_moe(x, w13, w2, experts, weights)
    for row in range(12):
        xs, ex, ws = torch.zeros_like(x[:4]), experts[:4].flip(0), torch.zeros_like(weights[:4])
        at = row % 4
        xs[at], ex[at], ws[at] = x[row], experts[row], weights[row]
        assert torch.equal(naive.routed_moe(xs, w13, w2, ex, ws)[at], whole[row]), f"row {row}"


def test_bad_fp8_experts_are_refused() -> None:
    """A stack whose scales, groups or weight do not fit, in any of the three MoEs."""
    x, w13, w2, experts, weights = make_fp8_moe((4, 160, 40, 3, 2, False), torch.float32)
    q, scales, groups = w13
    bad = {
        "scales must be": BlockFp8(q, scales[:, :1], groups),
        "groups must name": BlockFp8(q, scales, groups[:-1]),
        "must be fp32": BlockFp8(q, scales.double(), groups),
        "int32": BlockFp8(q, scales, groups.long()),
        "float8_e4m3fn": BlockFp8(q.float(), scales, groups),
    }
    for message, w in bad.items():
        for moe in (kt.fused_moe, naive.routed_moe, naive.dense_moe):
            with pytest.raises(ValueError, match=message):
                moe(x, w, w2, experts, weights)
    with pytest.raises(ValueError, match="w2.scales must be"):
        kt.fused_moe(x, w13, BlockFp8(w2.weight, w2.scales[:-1], w2.groups), experts, weights)
    with pytest.raises(ValueError, match="share one dtype"):
        kt.fused_moe(x, w13, w2, experts, weights.bfloat16())
    with pytest.raises(ValueError, match="contiguous"):
        kt.fused_moe(
            x,
            BlockFp8(q, scales.transpose(1, 2).contiguous().transpose(1, 2), groups),
            w2,
            experts,
            weights,
        )
