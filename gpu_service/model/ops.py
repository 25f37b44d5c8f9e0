"""Row-wise building blocks of the eager forward, batch invariant by construction.

Every per-row tensor is carried padded to a multiple of `ROW_TILE` rows, and every linear
runs as a batch of `ROW_TILE`-row matmuls: the CPU GEMM then picks one kernel whatever the
row count, so a row's bytes do not depend on how many rows share the call or where it sits.
"""

from __future__ import annotations

import torch

ROW_TILE = 16


def padded_rows(rows: int, tile: int = ROW_TILE) -> int:
    return -(-rows // tile) * tile


def pad_rows(x: torch.Tensor, tile: int = ROW_TILE) -> torch.Tensor:
    """x: [R, ...] -> [P, ...] with zero rows appended, P a multiple of `tile`."""
    extra = padded_rows(x.shape[0], tile) - x.shape[0]
    if extra == 0:
        return x
    return torch.cat([x, x.new_zeros(extra, *x.shape[1:])])


def linear(x: torch.Tensor, weight: torch.Tensor, tile: int = ROW_TILE) -> torch.Tensor:
    """x: [P, K] (P a multiple of `tile`), weight: [N, K] -> [P, N]. One caller, one tile:
    a row's bytes depend on the tile, never on the rows beside it."""
    rows, inner = x.shape
    if rows % tile:
        raise ValueError(f"linear takes rows padded to {tile}; got {rows}")
    tiles = x.reshape(rows // tile, tile, inner)
    return torch.matmul(tiles, weight.t()).reshape(rows, weight.shape[0])


def rope_table(rotary_dim: int, theta: float, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [length, rotary_dim] for rotate-half RoPE, computed once in fp32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    freqs = torch.arange(length, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Partial rotate-half RoPE over the first rotary dims. x: [P, H, d], cos/sin: [P, rot]"""
    rot = cos.shape[-1]
    xr, rest = x[..., :rot].float(), x[..., rot:]
    half = rot // 2
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    out = xr * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat([out.to(x.dtype), rest], dim=-1)
