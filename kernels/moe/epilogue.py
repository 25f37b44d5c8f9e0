"""What the routed experts' bf16 and FP8 kernels share: the rows of a block, the pipeline
stages, a program's block of sorted entries, and the epilogues that round where the torch
reference rounds."""

from __future__ import annotations

import triton
import triton.language as tl

# Rows of a block: the decode-sized batches of the flagship (k=10 of E=512) give most experts
# one or two pairs, and 16 is the least M `tl.dot` takes.
BLOCK_M = 16
NUM_STAGES = 3


@triton.jit
def _rounded(x, DTYPE: tl.constexpr):
    """x: fp32 -> fp32 rounded to DTYPE's precision, to nearest with ties to even as torch rounds.
    A bf16 value is rounded on its bits: the interpreter's own fp32 -> bf16 cast truncates."""
    if DTYPE == tl.bfloat16:
        b_bits = x.to(tl.uint32, bitcast=True)
        b_bits = (b_bits + 0x7FFF + ((b_bits >> 16) & 1)) & 0xFFFF0000
        return b_bits.to(tl.float32, bitcast=True)
    else:
        return x


@triton.jit
def _swiglu(b_gate, b_up, DTYPE: tl.constexpr):
    """The fp32 sums of gate and up -> silu(gate) * up, rounded where the reference rounds."""
    b_gate = _rounded(b_gate, DTYPE)
    b_act = _rounded(b_gate / (1.0 + tl.exp(-b_gate)), DTYPE)
    return _rounded(b_act * _rounded(b_up, DTYPE), DTYPE).to(DTYPE)


@triton.jit
def _weighted(b_acc, b_weight, DTYPE: tl.constexpr):
    """An expert's fp32 sum, rounded, times the pair's routing weight, rounded."""
    return _rounded(_rounded(b_acc, DTYPE) * b_weight[:, None], DTYPE).to(DTYPE)


@triton.jit
def _block_tile(pairs_ptr, block_experts_ptr, BM: tl.constexpr, BN: tl.constexpr):
    """A program's block of sorted entries and its columns: (entries, columns, each entry's
    pair, the block's expert)."""
    o_m = tl.program_id(0) * BM + tl.arange(0, BM)
    o_n = tl.program_id(1) * BN + tl.arange(0, BN)
    return o_m, o_n, tl.load(pairs_ptr + o_m), tl.load(block_experts_ptr + tl.program_id(0))
