"""The `triton` forwards' ops object: the per-layer parts as Triton kernels, each one varlen
launch over every sequence of a batched call, reading the call's `Batch` offsets."""

from __future__ import annotations

import torch

from gpu_service.model.backend import Cache, EagerOps
from gpu_service.model.batch import Batch
from gpu_service.model.config import ModelConfig
from gpu_service.model.ops import ROW_TILE
from gpu_service.model.state import DeviceState
from kernels.argmax.triton import argmax_confidence
from kernels.attention.triton import attention
from kernels.causal_conv1d.triton import causal_conv1d, causal_conv1d_update
from kernels.fold.triton import fold
from kernels.fp8.naive import BlockFp8
from kernels.fp8.triton import fp8_matmul
from kernels.gated_delta_rule.chunk import chunk_gated_delta_rule
from kernels.gated_delta_rule.recurrent import recurrent_gated_delta_rule
from kernels.matmul.triton import matmul
from kernels.moe.triton import fused_moe
from kernels.rmsnorm.triton import gated_rms_norm, rms_norm


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
    rows, cu, slots, vrows = batch.rows, batch.cu_seqlens, batch.seq_slot32, batch.seq_vrow32
    if cu is None or slots is None or vrows is None:
        raise ValueError("a draft batch (one row per sequence) reaches no GDN layer")
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    windows = state.conv[layer]
    if prefill:
        y = causal_conv1d(mixed[:rows], windows, weight, cu, slots)
    else:
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
        out[:rows] = recurrent_gated_delta_rule(*args, state.verify_gdn[layer], vrows, write_live)
    return out


class TritonOps(EagerOps):
    name = "triton"

    def linear(
        self, x: torch.Tensor, weight_t: torch.Tensor | BlockFp8, tile: int = ROW_TILE
    ) -> torch.Tensor:
        """The batch-invariant GEMM on a GPU, where cuBLAS picks its kernel by the row count.
        On the CPU the tiled torch product stays: it is batch invariant there already (see
        `gpu_service/model/ops.py`), and the interpreted GEMM would cost the suite minutes.
        `meta` takes the GPU's path: `tools.kernel_report` catches the launches there. FP8 weights
        go to the block-scaled FP8 GEMM (`kernels/fp8/triton.py`)."""
        if x.device.type == "cpu":
            return super().linear(x, weight_t, tile)
        if isinstance(weight_t, BlockFp8):
            return fp8_matmul(x, weight_t)
        return matmul(x, weight_t)

    def moe(
        self,
        x: torch.Tensor,
        w13: torch.Tensor | BlockFp8,
        w2: torch.Tensor | BlockFp8,
        experts: torch.Tensor,
        weights: torch.Tensor,
    ) -> torch.Tensor:
        """The fused grouped GEMM on a GPU (fixed shapes: it captures in a graph); on the CPU
        the routed torch path, batch invariant there already, for the reason `linear` gives
        (`meta` takes the GPU's path, as there)."""
        if x.device.type != "cpu":
            return fused_moe(x, w13, w2, experts, weights)
        return super().moe(x, w13, w2, experts, weights)

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, one_plus: torch.Tensor | None, eps: float
    ) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def gated_rms_norm(
        self, x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        return gated_rms_norm(x, z.contiguous(), weight, eps)

    def key_rows(self, batch: Batch, table: torch.Tensor) -> torch.Tensor | None:
        return None  # the kernel reads the block table

    def attend(self, q: torch.Tensor, cache: Cache, batch: Batch) -> torch.Tensor:
        cu, slots, starts = batch.cu_seqlens, batch.seq_slot32, batch.seq_start32
        if cu is None or slots is None or starts is None:  # a draft batch: a row a sequence
            i32 = torch.int32
            cu = torch.arange(batch.rows + 1, dtype=i32, device=q.device)
            slots, starts = batch.tile_slot.to(i32), batch.tile_pos.to(i32)
        # A prefill's rows are too many for the split partials' workspace; its query blocks
        # fill the GPU instead (the same bytes either way).
        split = batch.chunk == 0
        out = attention(
            q[: batch.rows],
            cache.k,
            cache.v,
            cu,
            slots,
            starts,
            cache.valid,
            1.0,
            split_keys=split,
            table=cache.table,
            causal=batch.causal,
        )
        padded = q.new_zeros(q.shape)
        padded[: batch.rows] = out
        return padded

    def mix_gdn(
        self,
        cfg: ModelConfig,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        batch: Batch,
        state: DeviceState,
        layer: int,
        weight: torch.Tensor,
        mode: str,
        write_live: bool,
    ) -> torch.Tensor:
        return mix_gdn(
            cfg, mixed, g, beta, batch, state, layer, weight, mode == "prefill", write_live
        )

    def argmax_logprob(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, conf = argmax_confidence(logits)
        return top, conf.log()

    def draft_argmax(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return argmax_confidence(logits)

    def fold(
        self, live: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, picks: torch.Tensor
    ) -> None:
        fold(live, rows, slots, picks)


TRITON = TritonOps()
