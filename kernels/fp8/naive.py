"""Block-scaled FP8 (the DeepSeek-V3 format Qwen publishes its FP8 checkpoints in) in plain
torch: the quantizers, and the linear the engine computes with FP8 weights, the reference of
the Triton GEMM beside it and the eager forward's own.

A checkpoint stores a linear's `weight` `[out, in]` as float8_e4m3fn and beside it
`weight_scale_inv` `[ceil(out / 128), ceil(in / 128)]` in fp32: the real weight is the FP8
value times its 128 x 128 block's scale. The engine keeps the weight as it keeps every linear,
`[in, out]`, fused and regrouped by output column (`gpu_service/model/packing.py`); a
regrouping can cut a block's columns apart, so each output column names its scale column
(`BlockFp8.groups`) in a grid `[ceil(in / 128), G]` whose columns are runs of output columns
that share a source block (G = out / 128 where no part is cut).

Activations are quantized dynamically, per row and per 128 columns, as vLLM and SGLang do for
these checkpoints: scale = max(|x|) / 448, x / scale cast to e4m3. The product then runs K block
by K block in order, each block's FP8 dot product (exact in fp32 on the CPU) scaled by the
row's activation scale and then by the column's weight scale, and added to an fp32 sum: a
row's bytes depend on nothing but the row, and the weight is upcast one K block of a bounded
run of columns at a time, never whole.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels.fp8.format import BLOCK, FP8_MAX

FP8 = torch.float8_e4m3fn
# A group or block of zeros gets this amax, not 0: its scale stays finite and its values 0.
MIN_AMAX = 1e-10
# fp32 bytes of one upcast weight tile (one K block of a run of columns) on the CPU.
TILE_BYTES = 8 << 20


# The bits of an e4m3 byte, sign-extended to 16 and shifted left by 7, that make the fp16 of
# the same sign, exponent field and mantissa: bit 15 and bits 7 to 13 (as a signed int16).
FP16_OF_E4M3 = 0xBF80 - 0x10000


class BlockFp8(NamedTuple):
    """A linear's weight as the engine holds it in FP8: `[K, N]`, or `[E, K, N]` for stacked
    experts, with its block scales."""

    weight: torch.Tensor  # [K, N] / [E, K, N] float8_e4m3fn
    scales: torch.Tensor  # [ceil(K / 128), G] / [E, ceil(K / 128), G] fp32: multiply to dequantize
    groups: torch.Tensor  # [N] int32: each output column's column of `scales`

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def device(self) -> torch.device:
        return self.weight.device


def blocks(n: int) -> int:
    return -(-n // BLOCK)


def _padded(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """x with each of `dims` zero-padded to a multiple of BLOCK."""
    pad: list[int] = []
    for d in range(x.dim() - 1, -1, -1):
        pad += [0, (-x.shape[d]) % BLOCK if d in dims else 0]
    return torch.nn.functional.pad(x, pad)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] -> (xq [M, K] float8_e4m3fn, scales [M, ceil(K / 128)] fp32): each row's
    128-column groups quantized on their own (the last group may be shorter)."""
    m, k = x.shape
    groups = _padded(x.float(), (1,)).view(m, -1, BLOCK)
    scales = groups.abs().amax(-1).clamp(min=MIN_AMAX) / FP8_MAX
    q = (groups / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(m, -1)[:, :k], scales


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint's weight [out, in] -> (FP8 [out, in], weight_scale_inv
    [ceil(out / 128), ceil(in / 128)] fp32), the published layout."""
    out, inp = w.shape
    tiles = _padded(w.float(), (0, 1)).view(blocks(out), BLOCK, blocks(inp), BLOCK)
    scales = tiles.abs().amax((1, 3)).clamp(min=MIN_AMAX) / FP8_MAX
    q = (tiles / scales[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(blocks(out) * BLOCK, -1)[:out, :inp].contiguous(), scales


def dequantize_blocks(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The published layout back to fp32: q [out, in] FP8, scale_inv [out / 128, in / 128]."""
    rows = scale_inv.repeat_interleave(BLOCK, 0)[: q.shape[0]]
    return q.float() * rows.repeat_interleave(BLOCK, 1)[:, : q.shape[1]]


def upcast(q: torch.Tensor) -> torch.Tensor:
    """FP8 (finite) -> fp32, exactly, several times faster than torch's own conversion on the
    CPU: each byte's sign, exponent and mantissa moved into an fp16's bits, whose exponent
    bias (15 against e4m3's 7) a multiply by 2^8 then corrects. An e4m3 subnormal lands on an
    fp16 subnormal, which the conversion to fp32 makes normal: nothing here depends on how
    the CPU treats fp32 subnormals."""
    bits = q.view(torch.int8).to(torch.int16)  # sign-extended: the sign fills bits 7 to 15
    bits <<= 7
    bits &= FP16_OF_E4M3
    return bits.view(torch.float16).float().mul_(256.0)


def column_scales(w: BlockFp8, kb: int) -> torch.Tensor:
    """K block `kb`'s scale of every output column: [N] (stacked experts: [E, N])."""
    return w.scales[..., kb, :].index_select(-1, w.groups)


def dequantize(w: BlockFp8) -> torch.Tensor:
    """The whole weight in fp32, in the engine's layout (tests and tools, never the forward)."""
    k = w.weight.shape[-2]
    per_row = torch.stack([column_scales(w, kb) for kb in range(blocks(k))], -2)
    return upcast(w.weight) * per_row.repeat_interleave(BLOCK, -2)[..., :k, :]


def column_runs(n: int, k: int) -> int:
    """Columns of one upcast weight tile: TILE_BYTES of fp32 over one K block, whole BLOCKs."""
    return max(BLOCK, TILE_BYTES // (4 * min(k, BLOCK)) // BLOCK * BLOCK)


def fp8_linear(x: torch.Tensor, w: BlockFp8, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x: [M, K] (bf16, fp16 or fp32), w: [K, N] -> x @ w: [M, N] in `out_dtype` (x's by
    default). Per K block in order: acc += (xq @ wq) * x_scale[:, None] * w_scale[None, :]."""
    m, k = x.shape
    if w.weight.dim() != 2 or w.weight.shape[0] != k:
        raise ValueError(
            f"fp8_linear: x {tuple(x.shape)} and weight {tuple(w.weight.shape)} do not multiply "
            "([M, K] @ [K, N])"
        )
    n = w.weight.shape[1]
    xq, sx = quantize_rows(x)
    acc = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    step = column_runs(n, k)
    for kb in range(blocks(k)):
        ks = slice(kb * BLOCK, min(k, kb * BLOCK + BLOCK))
        a = upcast(xq[:, ks])
        sw = column_scales(w, kb)
        for c in range(0, n, step):
            cols = slice(c, min(n, c + step))
            part = torch.mm(a, upcast(w.weight[ks, cols]))
            acc[:, cols] += part * sx[:, kb : kb + 1] * sw[None, cols]
    return acc.to(out_dtype or x.dtype)
