"""The device's figures beside the correctness checks: the greedy step with captured graphs on
and off, the batch-invariant GEMM's invariance and its speed against cuBLAS, our GDN and
attention kernels against the references users know (flash-linear-attention's fused recurrent
kernel, torch's `scaled_dot_product_attention`), and `met bench --quick`."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from gpu_service.engine.graphs import cuda_capture, replay_eagerly
from scripts.gpu_check.report import guarded
from scripts.gpu_check.settings import ROOT, Settings
from scripts.gpu_check.step import build_engine, one_step, profile_batch

# [K, N] of the linears of a Qwen3-Next-80B-A3B layer (hidden 2048): the GDN's in_proj_qkvz
# and out_proj, the attention's fused q-and-gate projection, an expert's gate_up and down, the
# LM head.
QWEN3_NEXT_LINEARS = [(2048, 12288), (4096, 2048), (2048, 8192), (2048, 1024), (512, 2048)]
QWEN3_NEXT_LM_HEAD = (2048, 151936)
# (key heads, value heads, key dim, value dim) of a Qwen3-Next GDN layer; its attention's
# (query heads, kv heads, head dim).
QWEN3_NEXT_GDN = (16, 32, 128, 128)
QWEN3_NEXT_ATTENTION = (16, 2, 256)


def _ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# -- captured graphs -------------------------------------------------------------------------


def check_graphs(settings: Settings, device: torch.device) -> dict:
    """One greedy step per batch size with the graphs off, then on (CUDA graphs on a GPU; on
    the CPU the same buffers replayed eagerly): launches and ms per step, and whether every
    step's tokens are the same."""
    engine = build_engine(settings, device)
    capture = cuda_capture if device.type == "cuda" else replay_eagerly
    runs: dict[str, dict] = {}
    tokens: dict[str, list] = {}
    for label, cap in (("off", None), ("on", capture)):
        engine.use_graphs(cap)
        runs[label] = {
            str(b): profile_batch(engine, b, settings, device) for b in settings.profile_batches
        }
        tokens[label] = [_greedy_tokens(engine, b) for b in settings.profile_batches]
    graphs = engine.choice.graphs
    assert graphs is not None
    engine.use_graphs(None)
    same = tokens["on"] == tokens["off"]
    summary = ", ".join(
        f"{b}: {runs['off'][b]['launches']} -> {runs['on'][b]['launches']} launches, "
        f"{runs['off'][b]['ms_per_step']:.2f} -> {runs['on'][b]['ms_per_step']:.2f} ms"
        for b in runs["on"]
    )
    return {
        "ok": same and graphs.replays > 0 and not graphs.failed,
        "summary": f"{summary}; tokens {'identical' if same else 'DIFFER'}",
        "off": runs["off"],
        "on": runs["on"],
        "identical": same,
        "captured": graphs.captures,
        "replays": graphs.replays,
        "fallbacks": graphs.fallbacks,
        "failed_captures": {str(k): why for k, why in graphs.failed.items()},
    }


def _greedy_tokens(engine, batch: int) -> list:
    results: list = []
    one_step(engine, batch, nullcontext(), results)
    return results


# -- the GEMM --------------------------------------------------------------------------------


def check_gemm(settings: Settings, device: torch.device) -> dict:
    """Row bytes against the row count (M = 1 .. settings.gemm_rows) at each shape, then our
    GEMM's time over cuBLAS's (`F.linear` on the [N, K] weight) at a few M."""
    from kernels.matmul.triton import matmul

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = [(128, 384), (128, 4096)]
    if device.type == "cuda":
        shapes += [*QWEN3_NEXT_LINEARS, QWEN3_NEXT_LM_HEAD]
    gen = torch.Generator().manual_seed(0)
    invariant, speed = {}, {}
    for k, n in shapes:
        w = (torch.randn(k, n, generator=gen) / k**0.5).to(dtype).to(device)
        x = torch.randn(settings.gemm_rows, k, generator=gen).to(dtype).to(device)
        ref = matmul(x, w)
        bad = [
            m
            for m in range(1, settings.gemm_rows + 1)
            if not torch.equal(matmul(x[:m], w), ref[:m])
        ]
        invariant[f"{k}x{n}"] = bad
        w_nk = w.t().contiguous()
        speed[f"{k}x{n}"] = {
            str(m): _gemm_speed(matmul, x[:m], w, w_nk, device, settings.repeats)
            for m in settings.gemm_speed_rows
        }
    ok = not any(invariant.values())
    # On the CPU the Triton GEMM runs interpreted: the ratio says nothing of its speed there.
    library = "cuBLAS" if device.type == "cuda" else "torch on the CPU, ours interpreted"
    ratios = [r["ratio"] for s in speed.values() for r in s.values()]
    return {
        "ok": ok,
        "summary": f"rows invariant over M = 1..{settings.gemm_rows} at {len(shapes)} shapes: "
        f"{'yes' if ok else 'NO'}; ours / {library} median {statistics.median(ratios):.2f}x "
        f"({min(ratios):.2f}-{max(ratios):.2f})",
        "library": library,
        "dtype": str(dtype).removeprefix("torch."),
        "variant_rows": invariant,
        "speed": speed,
    }


def _gemm_speed(
    matmul: Callable, x: torch.Tensor, w: torch.Tensor, w_nk: torch.Tensor, device, repeats: int
) -> dict:
    ours = _ms(lambda: matmul(x, w), device, repeats)
    lib = _ms(lambda: F.linear(x, w_nk), device, repeats)
    return {"ours_ms": ours, "cublas_ms": lib, "ratio": round(ours / lib, 3)}


# -- references -------------------------------------------------------------------------------


def check_references(settings: Settings, device: torch.device) -> dict:
    """Our recurrent GDN kernel against flash-linear-attention's fused recurrent one, and our
    attention kernel against `scaled_dot_product_attention`: each output's largest difference
    and the time ratio, at the default model's shapes and a Qwen3-Next layer's."""
    if device.type != "cuda":
        return {"ok": True, "summary": "timed on a GPU only (their Triton kernels)", "gdn": None}
    from gpu_service.model.config import ModelConfig

    cfg = ModelConfig.load(settings.model)
    gdn_shapes = {
        "default": (
            cfg.linear_num_key_heads,
            cfg.linear_num_value_heads,
            cfg.linear_key_head_dim,
            cfg.linear_value_head_dim,
        ),
        "qwen3_next": QWEN3_NEXT_GDN,
    }
    attn_shapes = {
        "default": (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim),
        "qwen3_next": QWEN3_NEXT_ATTENTION,
    }
    gdn = {
        f"{name}/{n}": _gdn_vs_fla(shape, n, device, settings.repeats)
        for name, shape in gdn_shapes.items()
        for n in settings.profile_batches
    }
    attention = {
        f"{name}/{n}": _attention_vs_sdpa(shape, n, device, settings.repeats)
        for name, shape in attn_shapes.items()
        for n in settings.profile_batches
    }
    ok = all(r["max_abs_diff"] < 2e-3 for r in (*gdn.values(), *attention.values()))
    ratios = lambda rs: ", ".join(f"{k} {r['ratio']:.2f}x" for k, r in rs.items())  # noqa: E731
    return {
        "ok": ok,
        "summary": f"GDN ours / fla: {ratios(gdn)}; attention ours / SDPA: {ratios(attention)}",
        "gdn": gdn,
        "attention": attention,
    }


def _gdn_vs_fla(
    shape: tuple[int, int, int, int], n: int, device: torch.device, repeats: int
) -> dict:
    """n sequences of 4 verify rows each, fp32 state, from a random initial state."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    from kernels.gated_delta_rule.recurrent import recurrent_gated_delta_rule

    hk, hv, dk, dv = shape
    rows, t = n * 4, 4
    gen = torch.Generator().manual_seed(n)
    q, k = (torch.randn(rows, hk, dk, generator=gen).to(device) for _ in range(2))
    v = torch.randn(rows, hv, dv, generator=gen).to(device)
    g = (-torch.rand(rows, hv, generator=gen)).to(device)
    beta = torch.rand(rows, hv, generator=gen).to(device)
    h0 = (torch.randn(n, hv, dk, dv, generator=gen) * 0.1).to(device)
    i32 = torch.int32
    cu = torch.arange(0, rows + 1, t, dtype=i32, device=device)
    slots = torch.arange(n, dtype=i32, device=device)
    pool = torch.zeros(rows, hv, dk, dv, device=device)
    vrows = torch.arange(0, rows, t, dtype=i32, device=device)

    def ours() -> torch.Tensor:
        live = h0.clone()
        return recurrent_gated_delta_rule(q, k, v, g, beta, live, cu, slots, pool, vrows, True)

    group = hv // hk

    def theirs() -> torch.Tensor:
        o, _ = fused_recurrent_gated_delta_rule(
            q.repeat_interleave(group, 1)[None],
            k.repeat_interleave(group, 1)[None],
            v[None],
            g=g[None],
            beta=beta[None],
            initial_state=h0.clone(),
            output_final_state=True,
            cu_seqlens=cu.long(),
            use_qk_l2norm_in_kernel=True,
        )
        return o[0]

    diff = (ours() - theirs().float()).abs().max().item()
    mine, ref = _ms(ours, device, repeats), _ms(theirs, device, repeats)
    return {"max_abs_diff": diff, "ours_ms": mine, "fla_ms": ref, "ratio": round(mine / ref, 3)}


def _attention_vs_sdpa(
    shape: tuple[int, int, int], n: int, device: torch.device, repeats: int
) -> dict:
    """n sequences, 4 query rows each at the end of 512 cached positions, bf16."""
    from kernels.attention.triton import attention

    hq, hkv, d = shape
    ctx, t = 512, 4
    gen = torch.Generator().manual_seed(n)
    dtype = torch.bfloat16
    k_cache, v_cache = (
        torch.randn(n, ctx, hkv, d, generator=gen).to(dtype).to(device) for _ in range(2)
    )
    q = torch.randn(n * t, hq, d, generator=gen).to(dtype).to(device)
    i32 = torch.int32
    cu = torch.arange(0, n * t + 1, t, dtype=i32, device=device)
    slots = torch.arange(n, dtype=i32, device=device)
    starts = torch.full((n,), ctx - t, dtype=i32, device=device)
    causal = (
        torch.arange(ctx, device=device)[None, :]
        <= (ctx - t + torch.arange(t, device=device))[:, None]
    )

    def ours() -> torch.Tensor:
        return attention(q, k_cache, v_cache, cu, slots, starts)

    def theirs() -> torch.Tensor:
        qs = q.view(n, t, hq, d).transpose(1, 2)
        ks, vs = (c.transpose(1, 2) for c in (k_cache, v_cache))
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=causal, enable_gqa=True)
        return out.transpose(1, 2).reshape(n * t, hq, d)

    diff = (ours().float() - theirs().float()).abs().max().item()
    mine, ref = _ms(ours, device, repeats), _ms(theirs, device, repeats)
    return {"max_abs_diff": diff, "ours_ms": mine, "sdpa_ms": ref, "ratio": round(mine / ref, 3)}


# -- met bench --quick ---------------------------------------------------------------------------


def check_bench(settings: Settings, device: torch.device) -> dict:
    """`met bench --quick` in a process of its own on the device: mtp against none."""
    if device.type != "cuda":
        return {
            "ok": True,
            "summary": "run on a GPU only (tests/tools/bench/test_bench.py runs it on the CPU)",
        }
    out = settings.out.parent / "bench_quick.json"
    done = subprocess.run(
        [sys.executable, "-m", "met", "bench", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    if done.returncode != 0:
        return {
            "ok": False,
            "summary": f"met bench exited {done.returncode}",
            "stderr": done.stderr[-3000:],
        }
    report = json.loads(out.read_text())
    rows = {(r["method"], r["concurrency"]): r["tok_s"] for r in report["methods"]}
    ratios = {
        str(c): round(rows[("mtp", c)] / rows[("none", c)], 3)
        for (m, c) in rows
        if m == "none" and ("mtp", c) in rows
    }
    summary = [
        f"at {c}: mtp {rows[('mtp', int(c))]:.0f} tok/s, none {rows[('none', int(c))]:.0f}, "
        f"{r:.2f}x"
        for c, r in ratios.items()
    ]
    return {
        "ok": True,
        "summary": ", ".join(summary),
        "mtp_over_none": ratios,
        "tok_s": {f"{m}/{c}": v for (m, c), v in rows.items()},
    }


def speed_checks(settings: Settings, device: torch.device) -> dict[str, dict]:
    return {
        "graphs": guarded(lambda: check_graphs(settings, device)),
        "gemm": guarded(lambda: check_gemm(settings, device)),
        "references": guarded(lambda: check_references(settings, device)),
        "bench": guarded(lambda: check_bench(settings, device)),
    }
