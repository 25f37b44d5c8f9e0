"""Where the Triton kernels run in these tests: the GPU when there is one (scripts/
gpu_check.sh), else the interpreter on the CPU."""

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def on(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEVICE) for t in tensors]


def moved_rows(m: int, tile: int) -> torch.Tensor:
    """M of 2 * `tile` rows, starting further on, on DEVICE. On a GPU a row lands anywhere in
    its tile. Under the interpreter it moves a whole tile and keeps its place in it: there
    `tl.dot` is numpy's BLAS, whose AVX2 kernels round a row by its place in the product, and
    that says nothing of the kernel."""
    start = 7 * m if DEVICE.type == "cuda" else tile * (m % 2)
    return ((torch.arange(m) + start) % (2 * tile)).to(DEVICE)
