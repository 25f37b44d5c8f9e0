"""The conv references against torch's conv1d, and the update form's windows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.causal_conv1d.naive import causal_conv1d, causal_conv1d_update


@pytest.mark.parametrize(
    ("t", "c", "w"), [(1, 8, 4), (5, 24, 4), (33, 40, 3)], ids=lambda v: str(v)
)
def test_matches_conv1d(t: int, c: int, w: int) -> None:
    gen = torch.Generator().manual_seed(t + c)
    x, window = torch.randn(t, c, generator=gen), torch.randn(w - 1, c, generator=gen)
    weight = torch.randn(c, w, generator=gen)
    full = torch.cat([window, x]).T[None]  # [1, C, W-1+T]
    expected = F.silu(F.conv1d(full, weight[:, None], groups=c))[0].T
    out, last = causal_conv1d(x, window, weight)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    out_u, windows = causal_conv1d_update(x, window, weight)
    assert torch.equal(out_u, out)
    assert torch.equal(windows[-1], last)
    for i in range(t):
        assert torch.equal(windows[i], torch.cat([window, x])[i + 1 : i + w])
