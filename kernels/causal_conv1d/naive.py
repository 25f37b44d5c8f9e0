"""Causal depthwise conv1d + SiLU over a sequence's rows, continuing from its window.

The window holds the previous `W - 1` inputs, oldest first. The taps are summed in a fixed
order, so a row's output does not depend on how many rows come with it."""

from __future__ import annotations

import torch

from kernels.common import silu


def _taps(xs: torch.Tensor, weight: torch.Tensor, rows: int) -> torch.Tensor:
    # xs: [W - 1 + rows, C], weight: [C, W] -> [rows, C]
    out = xs[0:rows] * weight[:, 0]
    for j in range(1, weight.shape[1]):
        out = out + xs[j : j + rows] * weight[:, j]
    return out


def causal_conv1d(
    x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill form. x: [T, C], window: [W-1, C], weight: [C, W] -> (out [T, C], window [W-1, C])"""
    xs = torch.cat([window.to(x.dtype), x])
    out = silu(_taps(xs, weight.to(x.dtype), x.shape[0]))
    return out, xs[xs.shape[0] - window.shape[0] :].clone()


def causal_conv1d_update(
    x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify form: also the window after every row.
    x: [T, C], window: [W-1, C], weight: [C, W] -> (out [T, C], windows [T, W-1, C])"""
    rows, width = x.shape[0], window.shape[0]
    xs = torch.cat([window.to(x.dtype), x])
    out = silu(_taps(xs, weight.to(x.dtype), rows))
    windows = torch.stack([xs[t + 1 : t + 1 + width] for t in range(rows)])
    return out, windows


def varlen_causal_conv1d(
    x: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor, src: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sequence of a batched call at once: row r's taps read `src[r * W .. r * W + W - 1]`
    of [the sequences' windows; x], oldest first, summed in tap order as `_taps` does.

    x: [P, C]; windows: [B, W-1, C]; weight: [C, W]; src: [P * W]
    -> (out [P, C], the window after each row [P, W-1, C])"""
    rows, width = x.shape[0], weight.shape[1]
    stream = torch.cat([windows.reshape(-1, x.shape[1]).to(x.dtype), x])
    taps = stream.index_select(0, src).view(rows, width, -1)  # [P, W, C]
    out = (taps * weight.t().to(x.dtype)).sum(1)
    return silu(out), taps[:, 1:]
