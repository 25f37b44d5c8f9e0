"""Row-wise building blocks of the eager forward, batch invariant by construction.

Every per-row tensor is carried padded to a multiple of `ROW_TILE` rows, and every linear
multiplies by its weight stored transposed, `[in, out]` and contiguous. Measured on the CPU
(torch 2.13, one thread, fp32 and bf16, the default model's shapes and 128 to 4096 wide, 4
to 1024 rows): with such a weight and a multiple of 4 rows the GEMM gives a row the same bytes
whatever the row count and wherever the row sits, and costs about half of the same product
with the `[out, in]` weight transposed on the fly (which differs by row count below 16 rows).
"""

from __future__ import annotations

import math

import torch

from gpu_service.model.config import ModelConfig, Yarn
from kernels.common import ROW_TILE, pad_rows, padded_rows
from kernels.fp8.naive import BlockFp8, fp8_linear

__all__ = ["ROW_TILE", "apply_rope", "linear", "pad_rows", "padded_rows", "rope_table"]


def linear(
    x: torch.Tensor, weight_t: torch.Tensor | BlockFp8, tile: int = ROW_TILE
) -> torch.Tensor:
    """x: [P, K] (P a multiple of `tile`), weight_t: [K, N] contiguous, or held in FP8 ->
    [P, N] in x's dtype"""
    if x.shape[0] % tile:
        raise ValueError(f"linear takes rows padded to {tile}; got {x.shape[0]}")
    if isinstance(weight_t, BlockFp8):
        return fp8_linear(x, weight_t)
    return torch.mm(x, weight_t)


def rope_table(cfg: ModelConfig, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [length, rotary_dim] for rotate-half RoPE, computed once in fp32 as
    transformers computes them (YaRN: its frequencies, cos and sin times its scale)."""
    dim, theta = cfg.rotary_dim, cfg.rope_theta
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    scale = 1.0
    if cfg.yarn is not None:
        inv_freq, scale = _yarn_inv_freq(cfg.yarn, inv_freq, dim, theta), cfg.yarn.scale
    freqs = torch.arange(length, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos() * scale, emb.sin() * scale


def _yarn_inv_freq(yarn: Yarn, inv_freq: torch.Tensor, dim: int, base: float) -> torch.Tensor:
    """YaRN (transformers' `_compute_yarn_parameters`): dimensions that turn fewer than
    `beta_slow` times over the original context are interpolated by `factor`, those turning
    more than `beta_fast` times kept, a linear ramp between."""
    original = yarn.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(yarn.beta_fast or 32), correction_dim(yarn.beta_slow or 1)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers does, against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    interpolation = inv_freq / yarn.factor
    return interpolation * (1 - extrapolation) + inv_freq * extrapolation


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Partial rotate-half RoPE over the first rotary dims, in place on a fresh x.
    x: [P, H, d], rope: [P, 2, rot] (cos, signed sin)"""
    rot = rope.shape[-1]
    xr = x[..., :rot]
    rotated = xr.roll(rot // 2, -1)  # (x2, x1)
    xr.copy_(torch.addcmul(xr * rope[:, None, 0], rotated, rope[:, None, 1]))
    return x
