"""Triton row argmax + softmax probability against `kernels/argmax/naive.py`."""

from __future__ import annotations

import pytest
import torch

from kernels.argmax import naive
from kernels.argmax import triton as kt
from tests.kernels.device import on


@pytest.mark.parametrize(
    ("rows", "vocab"), [(1, 320), (5, 1500), (19, 2049)], ids=["R1-V320", "R5-V1500", "R19-V2049"]
)
def test_argmax_confidence(rows: int, vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(rows, vocab, generator=gen) * 3
    x[0, 7] = x[0, vocab - 1] = 50.0  # a tie: the first index wins, as torch.argmax
    top, conf = (t.cpu() for t in kt.argmax_confidence(*on(x)))
    ref_top, ref_conf = naive.argmax_confidence(x)
    assert torch.equal(top, ref_top)
    torch.testing.assert_close(conf, ref_conf, atol=1e-6, rtol=1e-5)
