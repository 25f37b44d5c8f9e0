"""Qwen3-Next's routed experts as two grouped GEMMs over the (row, expert) pairs sorted by expert,
the design of vLLM's and SGLang's `fused_moe`, made batch invariant.

`align` sorts the P * k pairs by expert (stably, so rows ascend within an expert) and pads each
expert's run to a multiple of `BLOCK_M`, so that every block of `BLOCK_M` sorted entries belongs
to one expert. It uses fixed-shape torch ops only, sized by an upper bound on the padded length:
no host synchronisation, so a CUDA graph can capture it. `gate_up` multiplies each entry's row of
x by its expert's `w13` with `silu(gate) * up` fused; `down` multiplies that by the expert's `w2`,
scales it by the pair's routing weight and writes the pair's own row of a `[P * k, H]` buffer;
each row's k contributions are then added in increasing expert order, as the reference does.

Either expert stack may be block FP8 (`BlockFp8`): its GEMM then runs in
`kernels/moe/fp8.py`'s kernels, K block by K block of 128, the scale block.

A row's bytes do not depend on the other rows of the call: every tile has one shape whatever P
is, no split-K, and the K loop runs in one order. The kernels round where the reference rounds
(gate and up, silu(gate), their product, the expert's output and its weighted contribution, each
to x's dtype), so bf16 differs from it by the GEMMs' summation order alone. fp32 multiplies in
IEEE fp32, not TF32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common import interpreted
from kernels.fp8.naive import BlockFp8
from kernels.moe import fp8
from kernels.moe.epilogue import BLOCK_M, NUM_STAGES, _block_tile, _swiglu, _weighted
from kernels.moe.naive import Aligned, Experts, align, check_fp8_experts, sum_in_expert_order

# (BN, BK) of each GEMM. At the flagship's H=2048, I=512 in bf16, compiled for sm_90 with 4 warps
# and 3 stages: gate_up 91 registers and 72 KiB of shared memory, down 84 and 36 KiB, no spills;
# a decode step's programs (40 experts hit) then fit in one wave of an H100/H200.
GATE_UP_TILE = (64, 128)
DOWN_TILE = (128, 64)
NUM_WARPS = 4
DTYPES = (torch.float32, torch.bfloat16)


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    pairs_ptr,
    block_experts_ptr,
    used_ptr,
    o_ptr,
    num_pairs,
    hidden,
    inner,
    TOP_K: tl.constexpr,
    UPCAST: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    # x: [P, H], w: [E, H, 2I], o: [bound, I]
    pid_m = tl.program_id(0)
    if pid_m * BM >= tl.load(used_ptr):
        return
    o_m, o_n, b_pair, expert = _block_tile(pairs_ptr, block_experts_ptr, BM, BN)
    m_m, m_n = b_pair < num_pairs, o_n < inner
    p_x = x_ptr + (b_pair // TOP_K)[:, None] * hidden
    p_w = w_ptr + expert * hidden * 2 * inner + o_n[None, :]
    b_gate = tl.zeros([BM, BN], dtype=tl.float32)
    b_up = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, hidden, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < hidden
        m_w = m_k[:, None] & m_n[None, :]
        b_x = tl.load(p_x + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)
        b_wg = tl.load(p_w + o_k[:, None] * 2 * inner, mask=m_w, other=0.0)
        b_wu = tl.load(p_w + o_k[:, None] * 2 * inner + inner, mask=m_w, other=0.0)
        if UPCAST:
            b_x, b_wg, b_wu = b_x.to(tl.float32), b_wg.to(tl.float32), b_wu.to(tl.float32)
        b_gate += tl.dot(b_x, b_wg, input_precision="ieee")
        b_up += tl.dot(b_x, b_wu, input_precision="ieee")
    tl.store(
        o_ptr + o_m[:, None] * inner + o_n[None, :],
        _swiglu(b_gate, b_up, o_ptr.dtype.element_ty),
        mask=m_m[:, None] & m_n[None, :],
    )


@triton.jit
def _down_kernel(
    a_ptr,
    w_ptr,
    weights_ptr,
    pairs_ptr,
    block_experts_ptr,
    used_ptr,
    o_ptr,
    num_pairs,
    hidden,
    inner,
    UPCAST: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    # a: [bound, I], w: [E, I, H], weights: [P k], o: [P k, H]
    pid_m = tl.program_id(0)
    if pid_m * BM >= tl.load(used_ptr):
        return
    o_m, o_n, b_pair, expert = _block_tile(pairs_ptr, block_experts_ptr, BM, BN)
    m_m, m_n = b_pair < num_pairs, o_n < hidden
    p_w = w_ptr + expert * inner * hidden + o_n[None, :]
    b_acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, inner, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < inner
        b_a = tl.load(
            a_ptr + o_m[:, None] * inner + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0
        )
        b_w = tl.load(p_w + o_k[:, None] * hidden, mask=m_k[:, None] & m_n[None, :], other=0.0)
        if UPCAST:
            b_a, b_w = b_a.to(tl.float32), b_w.to(tl.float32)
        b_acc += tl.dot(b_a, b_w, input_precision="ieee")
    b_weight = tl.load(weights_ptr + b_pair, mask=m_m, other=0.0).to(tl.float32)
    b_out = _weighted(b_acc, b_weight, o_ptr.dtype.element_ty)
    tl.store(
        o_ptr + b_pair[:, None] * hidden + o_n[None, :], b_out, mask=m_m[:, None] & m_n[None, :]
    )


def _gate_up(
    x: torch.Tensor, w13: Experts, aligned: Aligned, act: torch.Tensor, top_k: int
) -> None:
    """act[entry] = silu(gate) * up of each sorted entry's row of x under its block's expert."""
    rows, hidden = x.shape
    inner = act.shape[1]
    common = dict(TOP_K=top_k, BM=BLOCK_M, num_stages=NUM_STAGES)
    index = (aligned.pairs, aligned.block_experts, aligned.num_used, act, rows * top_k)
    if isinstance(w13, BlockFp8):
        fp8.gate_up(x, w13, aligned, act, top_k)
        return
    bn, bk = GATE_UP_TILE
    grid = (aligned.pairs.numel() // BLOCK_M, triton.cdiv(inner, bn))
    _gate_up_kernel[grid](
        x,
        w13,
        *index,
        hidden,
        inner,
        UPCAST=interpreted(x) and x.dtype != torch.float32,
        BN=bn,
        BK=bk,
        num_warps=NUM_WARPS,
        **common,
    )


def _down(
    act: torch.Tensor, w2: Experts, weights: torch.Tensor, aligned: Aligned, out: torch.Tensor
) -> None:
    """out[pair] = weight * act[entry] @ w2 of each sorted entry's expert."""
    inner, hidden = act.shape[1], out.shape[1]
    common = dict(BM=BLOCK_M, num_stages=NUM_STAGES)
    index = (aligned.pairs, aligned.block_experts, aligned.num_used, out, out.shape[0])
    if isinstance(w2, BlockFp8):
        fp8.down(act, w2, weights, aligned, out)
        return
    bn, bk = DOWN_TILE
    grid = (aligned.pairs.numel() // BLOCK_M, triton.cdiv(hidden, bn))
    _down_kernel[grid](
        act,
        w2,
        weights,
        *index,
        hidden,
        inner,
        UPCAST=interpreted(act) and act.dtype != torch.float32,
        BN=bn,
        BK=bk,
        num_warps=NUM_WARPS,
        **common,
    )


def _contributions(
    x: torch.Tensor,
    w13: Experts,
    w2: Experts,
    experts: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """Each pair's weighted expert output. Same arguments as `fused_moe` -> [P k, H]"""
    rows, hidden = x.shape
    top_k = experts.shape[1]
    aligned = align(experts, w13.shape[0], BLOCK_M)
    act = torch.empty(aligned.pairs.numel(), w2.shape[1], dtype=x.dtype, device=x.device)
    out = torch.empty(rows * top_k, hidden, dtype=x.dtype, device=x.device)
    _gate_up(x, w13, aligned, act, top_k)
    _down(act, w2, weights.reshape(-1), aligned, out)
    return out


def _check_shapes(
    x: torch.Tensor,
    w13: Experts,
    w2: Experts,
    experts: torch.Tensor,
    weights: torch.Tensor,
) -> None:
    if x.dim() != 2 or x.shape[0] % 4 != 0:
        raise ValueError(f"fused_moe: x must be [P, H] with P a multiple of 4, not {_dims(x)}.")
    if len(w13.shape) != 3 or len(w2.shape) != 3 or w13.shape[1] != x.shape[1]:
        raise ValueError(
            f"fused_moe: w13 {_dims(w13)} must be [E, H, 2I] and w2 {_dims(w2)} [E, I, H] "
            f"for x {_dims(x)}."
        )
    e, h, i2 = w13.shape
    if w2.shape != (e, i2 // 2, h) or i2 % 2 != 0:
        raise ValueError(
            f"fused_moe: w13 {_dims(w13)} and w2 {_dims(w2)} are not one [E, H, 2I] and "
            "[E, I, H] pair."
        )
    if experts.dim() != 2 or experts.shape[0] != x.shape[0] or weights.shape != experts.shape:
        raise ValueError(
            f"fused_moe: experts {_dims(experts)} and weights {_dims(weights)} must both be "
            f"[P, k] for x {_dims(x)}."
        )
    check_fp8_experts("fused_moe", "w13", w13)
    check_fp8_experts("fused_moe", "w2", w2)


def _check_types(
    x: torch.Tensor,
    w13: Experts,
    w2: Experts,
    experts: torch.Tensor,
    weights: torch.Tensor,
) -> None:
    plain = [w for w in (w13, w2) if not isinstance(w, BlockFp8)]
    if x.dtype not in DTYPES or any(t.dtype != x.dtype for t in (*plain, weights)):
        kinds = ", ".join(
            "block FP8" if isinstance(w, BlockFp8) else str(w.dtype) for w in (w13, w2)
        )
        raise ValueError(
            f"fused_moe: x, weights and any w13 or w2 not block FP8 must share one dtype of "
            f"{', '.join(map(str, DTYPES))}; x is {x.dtype}, weights {weights.dtype}, and "
            f"w13, w2 {kinds}."
        )
    if experts.dtype != torch.int64:
        raise ValueError(f"fused_moe: experts must be int64, not {experts.dtype}.")
    tensors = {"x": x, "w13": w13, "w2": w2, "experts": experts, "weights": weights}
    devices = {name: str(t.device) for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"fused_moe: the tensors are on different devices: {devices}.")
    parts = [t for w in (w13, w2) for t in (w if isinstance(w, BlockFp8) else (w,))]
    if not all(t.is_contiguous() for t in parts):
        raise ValueError(
            "fused_moe: w13 and w2 (and their scales and groups) must be contiguous; the "
            "kernels index them flat."
        )


def _dims(t: torch.Tensor | BlockFp8) -> str:
    return f"[{', '.join(map(str, t.shape))}]"


def fused_moe(
    x: torch.Tensor,
    w13: Experts,
    w2: Experts,
    experts: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """x: [P, H] (P a multiple of 4), w13: [E, H, 2I] (gate columns, then up), w2: [E, I, H],
    experts: [P, k] int64 (each row's sorted, in [0, E): not checked, which would read the
    device), weights: [P, k] in x's dtype -> [P, H]: sum over j of
    weights[:, j] * MLP_experts[:, j](x), added in column order. Either stack may be block FP8
    (`BlockFp8`, `[E, K, N]` e4m3 with `[E, ceil(K / 128), G]` scales): its GEMM is then
    `fp8_linear`'s."""
    _check_shapes(x, w13, w2, experts, weights)
    _check_types(x, w13, w2, experts, weights)
    rows, top_k = experts.shape
    if rows == 0 or top_k == 0:
        return torch.zeros_like(x)
    out = _contributions(x.contiguous(), w13, w2, experts.contiguous(), weights.contiguous())
    return sum_in_expert_order(out.view(rows, top_k, -1))
