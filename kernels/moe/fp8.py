"""The routed experts' two grouped GEMMs with block-FP8 weights (`BlockFp8` stacks), the
FP8 path of `kernels/moe/triton.py`'s `fused_moe`: K block by K block of 128, the scale block,
as `kernels.fp8.naive.fp8_linear` does. Each block of the sorted rows is quantized in the kernel
per row, to `quantize_rows`'s bytes, its dot with the block's FP8 weights summed in fp32, scaled
by the row's and the column's scales and added to the fp32 sum; the rounding after the K loop is
the bf16 path's. The quantizing and the operands are the FP8 GEMM's (`kernels/fp8/triton.py`):
e4m3 on sm_89 and later, their exact fp16 values on sm_80, fp32 under the interpreter."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8 import triton as fp8_gemm
from kernels.fp8.naive import BLOCK, BlockFp8
from kernels.fp8.triton import _activation, _operand, _quantized
from kernels.moe.epilogue import BLOCK_M, NUM_STAGES, _block_tile, _swiglu, _weighted
from kernels.moe.naive import Aligned

# (BN, BK) of each GEMM with block-FP8 weights: BK is the scale block, so that a row's block is
# quantized and scaled whole in one step of the K loop. At the flagship's shapes with 8 warps and
# 3 stages: 128 registers on sm_80, 136 to 138 on sm_90 and sm_100, 44 KiB of shared memory, no
# spills; 4 warps take 178 to 255. At BM 16 Triton runs an e4m3 dot as mma.sync on the
# operands' fp16 values, which hold e4m3's exactly.
FP8_GATE_UP_TILE = (64, BLOCK)
FP8_DOWN_TILE = (128, BLOCK)
FP8_NUM_WARPS = 8
# What a launch binds by the GPU it runs on (`tools.compiling` compiles a launch caught on
# `meta` for each target with it): the FP8 GEMM's, whose quantizing and operands these share.
ARCH_CONSTEXPRS = fp8_gemm.ARCH_CONSTEXPRS


@triton.jit
def _gate_up_fp8_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    g_ptr,
    pairs_ptr,
    block_experts_ptr,
    used_ptr,
    o_ptr,
    num_pairs,
    hidden,
    inner,
    num_groups,
    TOP_K: tl.constexpr,
    DOT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    # x: [P, H], w: [E, H, 2I] e4m3 bytes, s: [E, ceil(H / BK), G], g: [2I], o: [bound, I]
    pid_m = tl.program_id(0)
    if pid_m * BM >= tl.load(used_ptr):
        return
    o_m, o_n, b_pair, expert = _block_tile(pairs_ptr, block_experts_ptr, BM, BN)
    m_m, m_n = b_pair < num_pairs, o_n < inner
    k_blocks = tl.cdiv(hidden, BK)
    p_x = x_ptr + (b_pair // TOP_K)[:, None] * hidden
    p_w = w_ptr + expert * hidden * 2 * inner + o_n[None, :]
    p_s = s_ptr + expert * k_blocks * num_groups
    b_g_gate = tl.load(g_ptr + o_n, mask=m_n, other=0)
    b_g_up = tl.load(g_ptr + inner + o_n, mask=m_n, other=0)
    b_gate = tl.zeros([BM, BN], dtype=tl.float32)
    b_up = tl.zeros([BM, BN], dtype=tl.float32)
    for kb in range(0, k_blocks):
        o_k = kb * BK + tl.arange(0, BK)
        m_k = o_k < hidden
        m_w = m_k[:, None] & m_n[None, :]
        b_x = tl.load(p_x + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)
        b_v, b_sx = _quantized(b_x.to(tl.float32))
        b_a = _activation(b_v, DOT)
        b_wg = _operand(tl.load(p_w + o_k[:, None] * 2 * inner, mask=m_w, other=0), DOT)
        b_wu = _operand(tl.load(p_w + o_k[:, None] * 2 * inner + inner, mask=m_w, other=0), DOT)
        b_swg = tl.load(p_s + kb * num_groups + b_g_gate)
        b_swu = tl.load(p_s + kb * num_groups + b_g_up)
        b_part = tl.dot(b_a, b_wg, input_precision="ieee")
        b_gate += b_part * b_sx[:, None] * b_swg[None, :]
        b_part = tl.dot(b_a, b_wu, input_precision="ieee")
        b_up += b_part * b_sx[:, None] * b_swu[None, :]
    tl.store(
        o_ptr + o_m[:, None] * inner + o_n[None, :],
        _swiglu(b_gate, b_up, o_ptr.dtype.element_ty),
        mask=m_m[:, None] & m_n[None, :],
    )


@triton.jit
def _down_fp8_kernel(
    a_ptr,
    w_ptr,
    s_ptr,
    g_ptr,
    weights_ptr,
    pairs_ptr,
    block_experts_ptr,
    used_ptr,
    o_ptr,
    num_pairs,
    hidden,
    inner,
    num_groups,
    DOT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    # a: [bound, I], w: [E, I, H] e4m3 bytes, s: [E, ceil(I / BK), G], g: [H], weights: [P k],
    # o: [P k, H]
    pid_m = tl.program_id(0)
    if pid_m * BM >= tl.load(used_ptr):
        return
    o_m, o_n, b_pair, expert = _block_tile(pairs_ptr, block_experts_ptr, BM, BN)
    m_m, m_n = b_pair < num_pairs, o_n < hidden
    k_blocks = tl.cdiv(inner, BK)
    p_w = w_ptr + expert * inner * hidden + o_n[None, :]
    p_s = s_ptr + expert * k_blocks * num_groups + tl.load(g_ptr + o_n, mask=m_n, other=0)
    b_acc = tl.zeros([BM, BN], dtype=tl.float32)
    for kb in range(0, k_blocks):
        o_k = kb * BK + tl.arange(0, BK)
        m_k = o_k < inner
        b_a = tl.load(
            a_ptr + o_m[:, None] * inner + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0
        )
        b_v, b_sx = _quantized(b_a.to(tl.float32))
        b_w = tl.load(p_w + o_k[:, None] * hidden, mask=m_k[:, None] & m_n[None, :], other=0)
        b_sw = tl.load(p_s + kb * num_groups)
        b_part = tl.dot(_activation(b_v, DOT), _operand(b_w, DOT), input_precision="ieee")
        b_acc += b_part * b_sx[:, None] * b_sw[None, :]
    b_weight = tl.load(weights_ptr + b_pair, mask=m_m, other=0.0).to(tl.float32)
    b_out = _weighted(b_acc, b_weight, o_ptr.dtype.element_ty)
    tl.store(
        o_ptr + b_pair[:, None] * hidden + o_n[None, :], b_out, mask=m_m[:, None] & m_n[None, :]
    )


def gate_up(
    x: torch.Tensor, w13: BlockFp8, aligned: Aligned, act: torch.Tensor, top_k: int
) -> None:
    """act[entry] = silu(gate) * up of each sorted entry's row of x under its block's expert."""
    rows, hidden = x.shape
    inner = act.shape[1]
    common = dict(TOP_K=top_k, BM=BLOCK_M, num_stages=NUM_STAGES)
    index = (aligned.pairs, aligned.block_experts, aligned.num_used, act, rows * top_k)
    bn, bk = FP8_GATE_UP_TILE
    grid = (aligned.pairs.numel() // BLOCK_M, triton.cdiv(inner, bn))
    _gate_up_fp8_kernel[grid](
        x,
        w13.weight.view(torch.uint8),
        w13.scales,
        w13.groups,
        *index,
        hidden,
        inner,
        w13.scales.shape[2],
        DOT=fp8_gemm.dot_of(x),
        BN=bn,
        BK=bk,
        num_warps=FP8_NUM_WARPS,
        **common,
    )


def down(
    act: torch.Tensor, w2: BlockFp8, weights: torch.Tensor, aligned: Aligned, out: torch.Tensor
) -> None:
    """out[pair] = weight * act[entry] @ w2 of each sorted entry's expert."""
    inner, hidden = act.shape[1], out.shape[1]
    common = dict(BM=BLOCK_M, num_stages=NUM_STAGES)
    index = (aligned.pairs, aligned.block_experts, aligned.num_used, out, out.shape[0])
    bn, bk = FP8_DOWN_TILE
    grid = (aligned.pairs.numel() // BLOCK_M, triton.cdiv(hidden, bn))
    _down_fp8_kernel[grid](
        act,
        w2.weight.view(torch.uint8),
        w2.scales,
        w2.groups,
        weights,
        *index,
        hidden,
        inner,
        w2.scales.shape[2],
        DOT=fp8_gemm.dot_of(act),
        BN=bn,
        BK=bk,
        num_warps=FP8_NUM_WARPS,
        **common,
    )
