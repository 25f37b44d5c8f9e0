"""The `triton` forward's GDN mix: one varlen kernel launch over every sequence of a batched
call for the conv and one for the gated delta rule, reading the call's `Batch` offsets."""

from __future__ import annotations

import torch

from gpu_service.config import ModelConfig
from gpu_service.model.batch import Batch
from gpu_service.state import DeviceState
from kernels.causal_conv1d.triton import causal_conv1d, causal_conv1d_update
from kernels.gated_delta_rule.chunk import chunk_gated_delta_rule
from kernels.gated_delta_rule.recurrent import recurrent_gated_delta_rule


def mix_gdn(
    cfg: ModelConfig,
    mixed: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    batch: Batch,
    state: DeviceState,
    layer: int,
    weight: torch.Tensor,
    prefill: bool,
    write_live: bool,
) -> torch.Tensor:
    """Conv + gated delta rule of every sequence. mixed: [P, conv_dim] -> [P, Hv, dv] fp32"""
    rows, cu, slots = batch.rows, batch.cu_seqlens, batch.seq_slot32
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    windows = state.conv[layer]
    if prefill:
        y = causal_conv1d(mixed[:rows], windows, weight, cu, slots)
    else:
        vrows = batch.seq_vrow32
        y = causal_conv1d_update(
            mixed[:rows], windows, weight, cu, slots, state.verify_conv[layer], vrows
        )
        if write_live:
            last = state.verify_conv[layer][batch.row_vrow[batch.last_row]]
            windows.index_put_((batch.seq_slot,), last)
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
        out[:rows] = recurrent_gated_delta_rule(
            *args, state.verify_gdn[layer], batch.seq_vrow32, write_live
        )
    return out
