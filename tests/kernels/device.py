"""Where the Triton kernels run in these tests: the GPU when there is one (scripts/
gpu_check.sh), else the interpreter on the CPU."""

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def on(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEVICE) for t in tensors]
