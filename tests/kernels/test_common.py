"""`pointwise` gives every element the vector path, whatever the tensor's size."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.common import pointwise
from kernels.rmsnorm.naive import gated_rms_norm, rms_norm


@pytest.mark.parametrize(
    "fn", [torch.sigmoid, F.silu, F.softplus, torch.exp], ids=["sigmoid", "silu", "softplus", "exp"]
)
def test_prefix_equals_slice_of_whole(fn) -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    whole = pointwise(fn, x)
    for n in (1, 7, 31, 33, 100):
        assert torch.equal(pointwise(fn, x[:n]), whole[:n])
    torch.testing.assert_close(whole, fn(x), atol=1e-6, rtol=1e-6)


def test_rms_norms() -> None:
    gen = torch.Generator().manual_seed(5)
    x, z, w = (torch.randn(3, 32, generator=gen) for _ in range(3))
    w = w[0]
    rms = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), rms * (1 + w), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(
        gated_rms_norm(x, z, w, 1e-6), w * rms * F.silu(z), atol=1e-6, rtol=1e-6
    )
