"""Tiled attention against plain softmax attention, and its row invariance."""

from __future__ import annotations

import pytest
import torch

from kernels.attention.naive import KEY_BLOCK, tiled_attention


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
def test_matches_softmax_attention(rows: int, start: int, hq: int, hkv: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    length = -(-(start + rows) // KEY_BLOCK) * KEY_BLOCK
    q = torch.randn(rows, hq, 16, generator=gen)
    keys, values = (
        torch.randn(length, hkv, 16, generator=gen),
        torch.randn(length, hkv, 16, generator=gen),
    )
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
