"""The fused MoE kernel (`kernels/moe/triton.py`, the triton forward's) against the eager
forward's routed path (`kernels/moe/naive.py`) at the flagship's shapes (Qwen3-Next-80B-A3B:
hidden 2048, expert inner 512, 512 experts, 10 routed), bf16: whether they agree and each one's
ms at a few row counts. Weights are random, the routing comes from random logits through
`route`. Under --cpu the same at tiny shapes, the kernel interpreted."""

from __future__ import annotations

import torch

from scripts.gpu_check.settings import Settings
from scripts.gpu_check.speed import _ms

# The kernels round where the reference rounds; only the GEMMs' summation order differs, which
# can move a rounded value (gate, up, an expert's output) by one unit in its last place, 2^-8
# relative, carried on by the steps after it: tests/kernels/test_moe.py's bound, absolute and
# relative.
TOLERANCE = 1.6e-2
DTYPE = torch.bfloat16


def _experts(shape: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """-> w13 [E, H, 2I], w2 [E, I, H], made on the device (3 GiB at the flagship's shapes)."""
    hidden, inner, num_experts, _ = shape
    gen = torch.Generator(device=device).manual_seed(0)
    w13 = torch.randn(num_experts, hidden, 2 * inner, generator=gen, device=device, dtype=DTYPE)
    w2 = torch.randn(num_experts, inner, hidden, generator=gen, device=device, dtype=DTYPE)
    return w13 / hidden**0.5, w2 / inner**0.5


def _compare(
    rows: int, w13: torch.Tensor, w2: torch.Tensor, top_k: int, repeats: int
) -> dict[str, float | bool]:
    """One row count: both paths' outputs compared, then each one timed."""
    from kernels.moe.naive import route, routed_moe
    from kernels.moe.triton import fused_moe

    device, (num_experts, hidden, _) = w13.device, w13.shape
    gen = torch.Generator(device=device).manual_seed(rows)
    x = torch.randn(rows, hidden, generator=gen, device=device, dtype=DTYPE)
    logits = torch.randn(rows, num_experts, generator=gen, device=device)
    weights, experts = route(logits, top_k, renormalize=True)
    args = (x, w13, w2, experts, weights.to(DTYPE))
    fused, routed = fused_moe(*args).float(), routed_moe(*args).float()
    fused_ms = _ms(lambda: fused_moe(*args), device, repeats)
    routed_ms = _ms(lambda: routed_moe(*args), device, repeats)
    return {
        "max_abs_diff": (fused - routed).abs().max().item(),
        "equal_fraction": round((fused == routed).float().mean().item(), 4),
        "within_tolerance": torch.allclose(fused, routed, atol=TOLERANCE, rtol=TOLERANCE),
        "experts_hit": len(experts.unique()),
        "fused_ms": fused_ms,
        "routed_ms": routed_ms,
        "ratio": round(fused_ms / routed_ms, 3),
    }


def check_moe(settings: Settings, device: torch.device) -> dict:
    if len(settings.moe_shape) != 4:
        raise ValueError(f"--moe-shape is H,I,E,k, not {settings.moe_shape}")
    hidden, inner, num_experts, top_k = settings.moe_shape
    w13, w2 = _experts(settings.moe_shape, device)
    rows = {str(p): _compare(p, w13, w2, top_k, settings.repeats) for p in settings.moe_rows}
    ok = all(r["within_tolerance"] for r in rows.values())
    # On the CPU the kernel runs interpreted: the ratio says nothing of its speed there.
    fused = "fused" if device.type == "cuda" else "fused (interpreted)"
    figures = ", ".join(
        f"P={p} {r['fused_ms']:.2f} vs {r['routed_ms']:.2f} ms" for p, r in rows.items()
    )
    worst = max(float(r["max_abs_diff"]) for r in rows.values())
    return {
        "ok": ok,
        "summary": f"{fused} / routed at H={hidden} I={inner} E={num_experts} k={top_k}: "
        f"{figures}; max |diff| {worst:.2e} {'within' if ok else 'OVER'} {TOLERANCE}",
        "shape": {"hidden": hidden, "inner": inner, "experts": num_experts, "top_k": top_k},
        "dtype": str(DTYPE).removeprefix("torch."),
        "tolerance": TOLERANCE,
        "rows": rows,
    }
