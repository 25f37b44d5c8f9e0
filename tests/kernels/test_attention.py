"""Tiled attention against plain softmax attention, its row invariance, and the Triton varlen
kernel against it (ragged rows, grouped heads, the drafter's validity mask)."""

from __future__ import annotations

import pytest
import torch

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


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "drafter-mask"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_matches_tiled(masked: bool, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    ctx, hq, hkv, d = 128, 4, 2, 16
    kc = torch.randn(4, ctx, hkv, d, generator=gen).to(dtype)
    vc = torch.randn(4, ctx, hkv, d, generator=gen).to(dtype)
    lens, starts, slots = [3, 1, 20], [10, 0, 40], [2, 0, 3]
    q = torch.randn(sum(lens), hq, d, generator=gen).to(dtype)
    valid = torch.rand(4, ctx, generator=gen) > 0.2
    for s, st, n in zip(slots, starts, lens, strict=True):
        valid[s, st : st + n] = True
    cu = torch.tensor([0, 3, 4, 24], dtype=torch.int32)
    dev = on(
        q,
        kc,
        vc,
        cu,
        torch.tensor(slots, dtype=torch.int32),
        torch.tensor(starts, dtype=torch.int32),
        valid,
    )
    out = kt.attention(*dev[:6], dev[6] if masked else None).cpu()
    # fp32: online softmax against the two-pass one; bf16: the output's rounding.
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i, (lo, hi) in enumerate(zip([0, 3, 4], [3, 4, 24], strict=True)):
        end = -(-(starts[i] + lens[i]) // KEY_BLOCK) * KEY_BLOCK
        ref = tiled_attention(
            q[lo:hi].float(),
            kc[slots[i], :end].float(),
            vc[slots[i], :end].float(),
            torch.arange(starts[i], starts[i] + lens[i]),
            valid[slots[i], :end] if masked else None,
        )
        torch.testing.assert_close(out[lo:hi].float(), ref, atol=tol, rtol=tol)
