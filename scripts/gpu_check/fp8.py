"""The block-scaled FP8 GEMM (`kernels/fp8/triton.py`, the triton forward's for FP8 checkpoints)
at the flagship's linears (Qwen3-Next-80B-A3B, hidden 2048): whether it agrees with
`kernels/fp8/naive.py`, and its ms at a few row counts beside the batch-invariant bf16 GEMM on the
same weights dequantized and beside torch's own FP8 GEMM (`scaled_mm` with the checkpoint's
1 x 128 and 128 x 128 block scales, or `torch._scaled_mm` with per-row ones) where this torch
and GPU have one; where not, the reason. Under --cpu the same at a tiny shape, the kernel
interpreted."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from scripts.gpu_check.settings import Settings
from scripts.gpu_check.speed import QWEN3_NEXT_LINEARS, _ms

# Both quantize x to the same bytes and multiply the same FP8 values; on a GPU the FP8 tensor
# cores add a block's 128 products in a narrower accumulator than naive's fp32, and the output
# is rounded to bf16 once: tests/kernels/test_fp8.py's bound on a GPU, for outputs of order 1.
TOLERANCE = 2e-2
DTYPE = torch.bfloat16
CPU_SHAPES = [(256, 256)]


def _weight(k: int, n: int, device: torch.device) -> tuple:
    """A random [K, N] weight quantized as a checkpoint is -> (BlockFp8, the checkpoint's
    [N, K] FP8 and [N / 128, K / 128] scales, the dequantized weight [K, N] in bf16)."""
    from kernels.fp8.naive import BLOCK, BlockFp8, dequantize, quantize_blocks

    gen = torch.Generator(device=device).manual_seed(k + n)
    q, scale_inv = quantize_blocks(torch.randn(n, k, generator=gen, device=device))
    groups = torch.arange(n, dtype=torch.int32, device=device) // BLOCK
    w = BlockFp8(q.t().contiguous(), scale_inv.t().contiguous(), groups)
    return w, q, scale_inv, dequantize(w).to(DTYPE)


def _torch_fp8(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor) -> Callable | str:
    """torch's FP8 GEMM for x @ W (W [N, K] FP8 with its block scales, the checkpoint's), as a
    function of nothing, or why this torch and GPU have none: the GEMM alone, x quantized
    beforehand. The block-scaled one first (the checkpoint's own scales); else per-row scales,
    whose numbers differ but whose time compares."""
    from kernels.fp8.naive import FP8, dequantize_blocks, quantize_rows

    if x.device.type != "cuda":
        return "a CUDA GEMM"
    reasons = []
    rows = x.shape[0]
    xp = F.pad(x, (0, 0, 0, -rows % 4))  # cuBLAS wants the activation scales' rows by 4
    xq, sx = quantize_rows(xp)
    kb = scale_inv.shape[1]
    sw = F.pad(scale_inv, (0, -kb % 4))  # and the weight's K blocks by 4
    if hasattr(F, "scaled_mm"):
        recipe = F.ScalingType

        def blockwise() -> torch.Tensor:
            return F.scaled_mm(
                xq,
                q.t(),
                sx.t().contiguous().t(),
                recipe.BlockWise1x128,
                sw.t(),
                recipe.BlockWise128x128,
                output_dtype=DTYPE,
            )[:rows]

        try:
            blockwise()
            return blockwise
        except Exception as e:
            reasons.append(f"blockwise scaled_mm: {type(e).__name__}: {str(e)[:200]}")
    else:
        reasons.append("no torch.nn.functional.scaled_mm (blockwise scales)")
    amax = x.float().abs().amax(1, keepdim=True).clamp(min=1e-10)
    xr = (x.float() * (448.0 / amax)).to(FP8)
    dense = dequantize_blocks(q, scale_inv)
    col_amax = dense.abs().amax(1, keepdim=True).clamp(min=1e-10)
    wr = (dense * (448.0 / col_amax)).to(FP8)
    row_scale, col_scale = amax / 448.0, (col_amax / 448.0).t().contiguous()

    def rowwise() -> torch.Tensor:
        return torch._scaled_mm(xr, wr.t(), row_scale, col_scale, out_dtype=DTYPE)

    try:
        rowwise()
        return rowwise
    except Exception as e:
        reasons.append(f"row-wise _scaled_mm: {type(e).__name__}: {str(e)[:200]}")
    return "; ".join(reasons)


def _compare(rows: int, k: int, n: int, weights: tuple, repeats: int) -> dict:
    """One shape at one row count: the FP8 GEMM against naive, then each GEMM timed."""
    from kernels.fp8.naive import fp8_linear
    from kernels.fp8.triton import fp8_matmul, plan
    from kernels.matmul.triton import matmul

    w, q, scale_inv, dense = weights
    device = w.device
    gen = torch.Generator(device=device).manual_seed(rows)
    # Outputs of order 1: x's columns weigh 1 / sqrt(K) of a unit of the weight.
    unit = dense.float().abs().mean()
    x = (torch.randn(rows, k, generator=gen, device=device) / (k**0.5 * unit)).to(DTYPE)
    got, ref = fp8_matmul(x, w).float(), fp8_linear(x, w).float()
    out: dict = {
        "max_abs_diff": (got - ref).abs().max().item(),
        "within_tolerance": torch.allclose(got, ref, atol=TOLERANCE, rtol=TOLERANCE),
        "fused": plan(rows, n, k).fused,
        "fp8_ms": _ms(lambda: fp8_matmul(x, w), device, repeats),
        "bf16_ms": _ms(lambda: matmul(x, dense), device, repeats),
    }
    out["fp8_over_bf16"] = round(out["fp8_ms"] / out["bf16_ms"], 3)
    theirs = _torch_fp8(x, q, scale_inv)
    if isinstance(theirs, str):
        out["torch_fp8"] = f"skipped: needs {theirs}" if device.type != "cuda" else theirs
    else:
        out["torch_fp8_ms"] = _ms(theirs, device, repeats)
        out["fp8_over_torch_fp8"] = round(out["fp8_ms"] / out["torch_fp8_ms"], 3)
        out["torch_fp8_max_abs_diff"] = (theirs().float() - ref).abs().max().item()
    return out


def _median(results: dict[str, dict], rows: int, key: str) -> str:
    values = [r[key] for name, r in results.items() if name.endswith(f"/{rows}") and key in r]
    return f"{statistics.median(values):.2f}x" if values else "-"


def check_fp8(settings: Settings, device: torch.device) -> dict:
    shapes = QWEN3_NEXT_LINEARS if device.type == "cuda" else CPU_SHAPES
    results: dict[str, dict] = {}
    for k, n in shapes:
        weights = _weight(k, n, device)
        for rows in settings.fp8_rows:
            results[f"{k}x{n}/{rows}"] = _compare(rows, k, n, weights, settings.repeats)
    ok = all(r["within_tolerance"] for r in results.values())
    worst = max(float(r["max_abs_diff"]) for r in results.values())
    # On the CPU the kernels run interpreted: the ratios say nothing of their speed there.
    ours = "fp8" if device.type == "cuda" else "fp8 (interpreted)"
    by_rows = ", ".join(f"M={m} {_median(results, m, 'fp8_over_bf16')}" for m in settings.fp8_rows)
    if any("fp8_over_torch_fp8" in r for r in results.values()):
        versus = ", ".join(
            f"M={m} {_median(results, m, 'fp8_over_torch_fp8')}" for m in settings.fp8_rows
        )
    else:
        versus = next(iter(results.values()))["torch_fp8"]
    return {
        "ok": ok,
        "summary": f"{ours} / bf16 GEMM (median over {len(shapes)} shapes): {by_rows}; "
        f"/ torch fp8: {versus}; max |diff| from naive {worst:.2e}, "
        f"{'within' if ok else 'OVER'} {TOLERANCE} + {TOLERANCE} |naive|",
        "dtype": str(DTYPE).removeprefix("torch."),
        "tolerance": TOLERANCE,
        "speed": results,
    }
