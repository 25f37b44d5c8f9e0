"""The Triton fold against `kernels/fold/naive.py`: a gather, so byte-equal."""

from __future__ import annotations

import torch

from kernels.fold import naive
from kernels.fold import triton as kt
from tests.kernels.device import on


def test_fold_picks_rows_into_slots() -> None:
    gen = torch.Generator().manual_seed(0)
    live = torch.randn(3, 6, 4, 5, 7, generator=gen)
    rows = torch.randn(3, 11, 4, 5, 7, generator=gen)
    expected = live.clone()
    naive.fold(expected, rows, [5, 0, 3], [10, 2, 4])
    live, rows = on(live, rows)
    kt.fold(live, rows, [5, 0, 3], [10, 2, 4])
    live = live.cpu()
    assert torch.equal(live, expected)
