"""The fused MoE kernels (`kernels/moe/triton.py`) against `kernels/moe/naive.py`, a row's bytes
against the batch it shares, the alignment of the pairs into expert blocks, and the refusals."""

from __future__ import annotations

import pytest
import torch

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
) -> tuple[torch.Tensor, ...]:
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


@pytest.mark.parametrize("dtype", list(TOL), ids=DTYPE_IDS.get)
def test_row_bytes_do_not_depend_on_the_batch(dtype: torch.dtype) -> None:
    """Each row of a 12-row batch run again in a smaller batch, byte for byte. On a GPU the row
    sits alone at one place of 4 rows whose others are zero rows routed elsewhere, so its pairs
    move within their blocks. Under the interpreter its pairs keep their places: the batch is
    the rows up to it (to the next four), the others zeroed but routed as before, because
    there `tl.dot` is numpy's BLAS, whose AVX2 kernels round a row by its place in the product
    (which says nothing of the kernel)."""
    x, w13, w2, experts, weights = on(*make_moe((12, 96, 40, 8, 3, False), dtype))
    whole = kt.fused_moe(x, w13, w2, experts, weights)
    pad_experts = torch.tensor([[0, 1, 2]], device=x.device).expand(4, 3).clone()
    for row in range(12):
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
