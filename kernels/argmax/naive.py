"""Each row's argmax (first on ties) and its softmax probability, in fp32."""

from __future__ import annotations

import torch

from kernels.common import exp


def argmax_confidence(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [n, V] -> (argmax [n] int64, probability of it [n] fp32)"""
    lf = logits.float()
    top = lf.argmax(-1)
    peak = lf.amax(-1, keepdim=True)
    return top, 1.0 / exp(lf - peak).sum(-1)
