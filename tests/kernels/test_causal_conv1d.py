"""The conv references against torch's conv1d, the update form's windows, and the Triton
varlen kernels against the references (ragged, non-contiguous slots)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.causal_conv1d import naive
from kernels.causal_conv1d import triton as kt
from tests.kernels.device import on


@pytest.mark.parametrize(
    ("t", "c", "w"), [(1, 8, 4), (5, 24, 4), (33, 40, 3)], ids=lambda v: str(v)
)
def test_naive_matches_conv1d(t: int, c: int, w: int) -> None:
    gen = torch.Generator().manual_seed(t + c)
    x, window = torch.randn(t, c, generator=gen), torch.randn(w - 1, c, generator=gen)
    weight = torch.randn(c, w, generator=gen)
    full = torch.cat([window, x]).T[None]  # [1, C, W-1+T]
    expected = F.silu(F.conv1d(full, weight[:, None], groups=c))[0].T
    out, last = naive.causal_conv1d(x, window, weight)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    out_u, windows = naive.causal_conv1d_update(x, window, weight)
    assert torch.equal(out_u, out)
    assert torch.equal(windows[-1], last)
    for i in range(t):
        assert torch.equal(windows[i], torch.cat([window, x])[i + 1 : i + w])


@pytest.mark.parametrize(
    ("lens", "c", "w"),
    [([1], 16, 4), ([3, 1, 6], 40, 4), ([2, 5], 200, 4), ([17, 1, 40], 24, 3)],
    ids=["N1-C16-W4", "ragged-C40-W4", "N2-C200-W4", "blocks-C24-W3"],
)
def test_triton_matches_naive(lens: list[int], c: int, w: int) -> None:
    gen = torch.Generator().manual_seed(c)
    windows = torch.randn(6, w - 1, c, generator=gen)
    weight = torch.randn(c, w, generator=gen)
    x = torch.randn(sum(lens), c, generator=gen)
    slots = [5, 0, 3][: len(lens)]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    slot_t = torch.tensor(slots, dtype=torch.int32)
    # Each sequence's verify rows start 2 past its first row: the pool is not the batch's rows.
    vrows = cu[:-1] + 2
    rows = torch.zeros(sum(lens) + 2, w - 1, c)
    before = windows.clone()
    dev = on(x, windows, weight, cu, slot_t, rows, vrows)
    out = kt.causal_conv1d_update(*dev).cpu()
    assert torch.equal(dev[1].cpu(), before), "the update form leaves the live windows alone"
    prefill_out = kt.causal_conv1d(*dev[:5]).cpu()
    rows, windows = dev[5].cpu(), dev[1].cpu()
    for i, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        ref, ref_rows = naive.causal_conv1d_update(x[lo:hi], before[slots[i]], weight)
        # fp32: silu as x * sigmoid(x) against torch's silu.
        torch.testing.assert_close(out[lo:hi], ref, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(prefill_out[lo:hi], ref, atol=1e-6, rtol=1e-5)
        assert torch.equal(rows[lo + 2 : hi + 2], ref_rows)
        assert torch.equal(windows[slots[i]], ref_rows[-1])
