"""The `triton` forward's per-sequence parts: one varlen kernel launch over every segment of a
batched call, where the eager forward loops over segments. Linears and the other row-wise
parts stay the eager forward's (their row tiles keep batch invariance)."""

from __future__ import annotations

import torch

from gpu_service.config import ModelConfig
from gpu_service.state import DeviceState
from kernels.attention.triton import attention
from kernels.causal_conv1d.triton import causal_conv1d, causal_conv1d_update
from kernels.gated_delta_rule.chunk import chunk_gated_delta_rule
from kernels.gated_delta_rule.recurrent import recurrent_gated_delta_rule
from kernels.rmsnorm.triton import gated_rms_norm, rms_norm

__all__ = ["attend", "mix_gdn", "rms_norm", "gated_rms_norm"]


def _ints(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def _layout(
    segs: list, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(row offsets [n + 1], slots [n], first positions [n], rows) of consecutive segments."""
    cu = [s.row for s in segs] + [segs[-1].row + segs[-1].count]
    ints = [_ints(v, device) for v in (cu, [s.slot for s in segs], [s.start for s in segs])]
    return ints[0], ints[1], ints[2], cu[-1]


def attend(
    q: torch.Tensor,
    segs: list,
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
) -> torch.Tensor:
    """q: [P, Hq, d] over the cached keys and values (the rows' own already in) -> [P, Hq, d]"""
    k_cache, v_cache, valid = cache
    cu, slots, starts, rows = _layout(segs, q.device)
    out = q.new_zeros(q.shape)
    out[:rows] = attention(q[:rows], k_cache, v_cache, cu, slots, starts, valid)
    return out


def mix_gdn(
    cfg: ModelConfig,
    mixed: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    segs: list,
    state: DeviceState,
    layer: int,
    weight: torch.Tensor,
    prefill: bool,
    write_live: bool,
) -> torch.Tensor:
    """Conv + gated delta rule of every segment. mixed: [P, conv_dim] -> [P, Hv, dv] fp32"""
    cu, slots, _, rows = _layout(segs, mixed.device)
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    windows = state.conv[layer]
    if prefill:
        y = causal_conv1d(mixed[:rows], windows, weight, cu, slots)
    else:
        vrows = _ints([state.verify_offset[s.slot] for s in segs], mixed.device)
        y = causal_conv1d_update(
            mixed[:rows], windows, weight, cu, slots, state.verify_conv[layer], vrows
        )
        if write_live:
            for s, vr in zip(segs, vrows.tolist(), strict=True):
                windows[s.slot] = state.verify_conv[layer, vr + s.count - 1]
    yq, yk, yv = y.split([cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
    args = (
        yq.reshape(rows, hk, dk),
        yk.reshape(rows, hk, dk),
        yv.reshape(rows, hv, dv),
        g[:rows].contiguous(),
        beta[:rows].contiguous(),
        state.gdn[layer],
        cu,
        slots,
    )
    out = torch.zeros(mixed.shape[0], hv, dv, device=mixed.device)
    if prefill:
        out[:rows] = chunk_gated_delta_rule(*args)
    else:
        out[:rows] = recurrent_gated_delta_rule(*args, state.verify_gdn[layer], vrows, write_live)
    return out
