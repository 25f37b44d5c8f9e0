"""Tiled attention against plain softmax attention, its row invariance, and the Triton varlen
kernels against it (ragged rows, grouped heads, the drafter's validity mask, keys cut into
splits), with a row's bytes independent of its batch, its sequence's other rows and the path."""

from __future__ import annotations

import pytest
import torch

from kernels.attention import splits
from kernels.attention import triton as kt
from kernels.attention.naive import KEY_BLOCK, tiled_attention
from tests.kernels.device import on


def _reference(q, keys, values, q_pos, valid):
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, 1).float()
    v = values.repeat_interleave(group, 1).float()
    scores = torch.einsum("thd,lhd->htl", q.float(), k) * q.shape[-1] ** -0.5
    mask = (torch.arange(keys.shape[0])[None] <= q_pos[:, None]) & valid[None]
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("htl,lhd->thd", scores.softmax(-1), v)


@pytest.mark.parametrize(
    ("rows", "start", "hq", "hkv"),
    [(1, 0, 2, 2), (3, 61, 4, 2), (17, 100, 4, 1)],
    ids=["T1-L1", "T3-L64", "T17-L117"],
)
def test_tiled_matches_softmax_attention(rows: int, start: int, hq: int, hkv: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    length = -(-(start + rows) // KEY_BLOCK) * KEY_BLOCK
    q = torch.randn(rows, hq, 16, generator=gen)
    keys = torch.randn(length, hkv, 16, generator=gen)
    values = torch.randn(length, hkv, 16, generator=gen)
    valid = torch.rand(length, generator=gen) > 0.2
    valid[start] = True
    pos = torch.arange(start, start + rows)
    out = tiled_attention(q, keys, values, pos, valid)
    torch.testing.assert_close(out, _reference(q, keys, values, pos, valid), atol=1e-5, rtol=1e-5)


def test_row_bytes_do_not_depend_on_rows_or_cache_length() -> None:
    gen = torch.Generator().manual_seed(0)
    keys, values = torch.randn(192, 2, 16, generator=gen), torch.randn(192, 2, 16, generator=gen)
    q = torch.randn(4, 4, 16, generator=gen)
    together = tiled_attention(q, keys, values, torch.arange(60, 64))
    for t in range(4):
        end = -(-(61 + t) // KEY_BLOCK) * KEY_BLOCK
        alone = tiled_attention(q[t : t + 1], keys[:end], values[:end], torch.tensor([60 + t]))
        assert torch.equal(alone[0], together[t])


# -- the Triton kernels, with keys cut into splits -------------------------------------------

CTX = 320
# Four splits at most, of 32 keys up to 128 keys a row, of 64 up to 256, of 96 up to 384.
MIN_KEYS, MAX_SPLITS = 32, 4
# (slot, start, rows) of each sequence: rows whose split size changes inside one query block
# (126..130 keys), a decode over four splits of 96, two query blocks over two splits, one key.
SEQS = [(1, 125, 5), (0, 300, 1), (3, 40, 20), (2, 0, 1)]


@pytest.fixture
def small_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(splits, "MIN_KEYS_PER_SPLIT", MIN_KEYS)
    monkeypatch.setattr(splits, "MAX_SPLITS", MAX_SPLITS)


def _case(hq: int, hkv: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    d = 16
    valid = torch.rand(4, CTX, generator=gen) > 0.2
    for slot, start, rows in SEQS:
        valid[slot, start : start + rows] = True
    return {
        "q": torch.randn(sum(r for _, _, r in SEQS), hq, d, generator=gen).to(dtype),
        "k": torch.randn(4, CTX, hkv, d, generator=gen).to(dtype),
        "v": torch.randn(4, CTX, hkv, d, generator=gen).to(dtype),
        "valid": valid,
    }


def _run(
    c: dict[str, torch.Tensor],
    seqs: list[tuple[int, int, int]],
    rows: list[int],
    masked: bool = True,
    split_keys: bool = True,
    causal: bool = True,
) -> torch.Tensor:
    """The kernels over `seqs`, whose query rows are `c["q"][rows]`, in that order."""
    counts = torch.tensor([0] + [r for _, _, r in seqs])
    cu = counts.cumsum(0).to(torch.int32)
    i32 = torch.int32
    slots = torch.tensor([s for s, _, _ in seqs], dtype=i32)
    starts = torch.tensor([st for _, st, _ in seqs], dtype=i32)
    q, k, v, valid, cu, slots, starts = on(
        c["q"][rows], c["k"], c["v"], c["valid"], cu, slots, starts
    )
    valid = valid if masked else None
    out = kt.attention(q, k, v, cu, slots, starts, valid, None, split_keys, causal=causal)
    return out.cpu()


def _first_rows() -> list[int]:
    return [0, *torch.tensor([r for _, _, r in SEQS]).cumsum(0).tolist()]


@pytest.mark.usefixtures("small_splits")
@pytest.mark.parametrize("split_keys", [True, False], ids=["split", "prefill"])
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "drafter-mask"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_matches_tiled(split_keys: bool, masked: bool, dtype: torch.dtype) -> None:
    c = _case(4, 2, dtype, seed=3)
    out = _run(c, SEQS, list(range(len(c["q"]))), masked, split_keys)
    # fp32: the splits' online softmax against the two-pass one; bf16: the output's rounding.
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    first = _first_rows()
    for (slot, start, rows), lo in zip(SEQS, first, strict=False):
        end = -(-(start + rows) // KEY_BLOCK) * KEY_BLOCK
        ref = tiled_attention(
            c["q"][lo : lo + rows].float(),
            c["k"][slot, :end].float(),
            c["v"][slot, :end].float(),
            torch.arange(start, start + rows),
            c["valid"][slot, :end] if masked else None,
        )
        torch.testing.assert_close(out[lo : lo + rows].float(), ref, atol=tol, rtol=tol)


@pytest.mark.usefixtures("small_splits")
def test_a_rows_bytes_depend_on_its_own_keys_alone() -> None:
    """Each sequence alone and in the batch, each row decoded alone, and the prefill path:
    the same bytes. Two query heads on one KV head."""
    c = _case(2, 1, torch.float32, seed=5)
    every = list(range(len(c["q"])))
    batch = _run(c, SEQS, every)
    assert torch.equal(_run(c, SEQS, every, split_keys=False), batch), "prefill path"
    for (slot, start, rows), lo in zip(SEQS, _first_rows(), strict=False):
        alone = _run(c, [(slot, start, rows)], list(range(lo, lo + rows)))
        assert torch.equal(alone, batch[lo : lo + rows]), f"sequence at {start} alone"
    slot, start, rows = SEQS[0]  # the rows whose split size changes
    for t in range(rows):
        alone = _run(c, [(slot, start + t, 1)], [t])
        assert torch.equal(alone, batch[t : t + 1]), f"row at {start + t} decoded alone"


@pytest.mark.usefixtures("small_splits")
def test_splits_a_row_cannot_see_add_nothing() -> None:
    """A row whose first splits are all masked, and a row that sees no key: no NaN, and the
    reference's output (zeros for the row that sees nothing)."""
    c = _case(2, 2, torch.float32, seed=7)
    c["valid"][1, :160] = False  # the decode at 200 (splits of 64): splits 0-1 and part of 2
    c["valid"][2, 0] = False  # the row at 0 sees nothing
    seqs = [(1, 200, 1), (2, 0, 1)]
    for split_keys in (True, False):
        out = _run(c, seqs, [0, 1], split_keys=split_keys)
        assert not out.isnan().any()
        ref = tiled_attention(c["q"][:1], c["k"][1], c["v"][1], torch.tensor([200]), c["valid"][1])
        torch.testing.assert_close(out[:1], ref, atol=1e-5, rtol=1e-5)
        assert torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.usefixtures("small_splits")
def test_split_rule_and_workspace() -> None:
    """The host's `num_splits` is the kernel's: a row's partials are written for exactly its
    splits, into a workspace of `workspace_bytes`."""
    c = _case(2, 2, torch.float32, seed=9)
    rows, hq, d = c["q"].shape
    cu = torch.tensor([0] + [r for _, _, r in SEQS]).cumsum(0).to(torch.int32)
    slots = torch.tensor([s for s, _, _ in SEQS], dtype=torch.int32)
    starts = torch.tensor([st for _, st, _ in SEQS], dtype=torch.int32)
    workspace = torch.full((splits.workspace_bytes(rows, hq, d) // 4,), float("nan"))
    q, k, v, cu, slots, starts, valid, workspace = on(
        c["q"], c["k"], c["v"], cu, slots, starts, c["valid"], workspace
    )
    _, stat = kt.split_partials(q, k, v, cu, slots, starts, valid, d**-0.5, workspace)
    assert stat.shape == (rows, hq, MAX_SPLITS, 2)
    positions = torch.cat([torch.arange(st, st + r) for _, st, r in SEQS])
    expected = torch.arange(MAX_SPLITS) < torch.tensor(
        [splits.num_splits(int(p) + 1) for p in positions]
    ).unsqueeze(1)
    written = ~stat.cpu()[..., 1].isnan()  # [rows, hq, splits]
    assert torch.equal(written, expected.unsqueeze(1).expand(-1, hq, -1))
    assert expected.sum(1).tolist()[:5] == [4, 4, 4, 3, 3], "126..128 keys; 129, 130"


def test_one_long_sequence_fills_an_h200() -> None:
    """At the module's split rule: one decode over 32,768 keys (or any count from 2,049) at
    Qwen3-Next's 16 query heads runs a working program per SM of an H200 (132)."""
    assert 16 * splits.num_splits(32768) >= 132
    assert min(16 * splits.num_splits(n) for n in range(2049, 300_000, 97)) >= 132


@pytest.mark.usefixtures("small_splits")
@pytest.mark.parametrize("split_keys", [True, False], ids=["split", "prefill"])
def test_block_mode_sees_the_whole_block(split_keys: bool) -> None:
    """A DFlash block (`causal=False`): every row of a sequence sees the keys up to its last
    row, as the softmax reference with that mask computes (fp32, 1e-5)."""
    c = _case(4, 2, torch.float32, seed=5)
    out = _run(c, SEQS, list(range(len(c["q"]))), False, split_keys, causal=False)
    for (slot, start, rows), lo in zip(SEQS, _first_rows(), strict=False):
        last = torch.full((rows,), start + rows - 1)
        ref = _reference(
            c["q"][lo : lo + rows],
            c["k"][slot],
            c["v"][slot],
            last,
            torch.ones(CTX, dtype=torch.bool),
        )
        torch.testing.assert_close(out[lo : lo + rows], ref, atol=1e-5, rtol=1e-5)
