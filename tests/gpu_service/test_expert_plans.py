"""Plans under expert parallelism (`--expert-parallel`): Qwen3.5-397B-A17B in FP8 on eight H200s
holds 64 experts a rank; Qwen3.5-122B-A10B (its config assembled from published sizes) in FP8
on 2 and 4 ranks of H200s and H100s, and in bf16, where two H100s are too few. A rank under EP
holds the bytes TP gives it, cut by expert rather than by width, and its workspace holds the
exchange's buffers."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from gpu_service.sizing import plan, plan_report
from gpu_service.sizing.plan_graphs import exchange_bytes
from kernels.attention.format import KEY_BLOCK
from met.main import build_parser

MODELS = Path(__file__).resolve().parents[2] / "gpu_service/models"
H200, H100 = "141GB", "80GB"


def _plan(model: str, memory: str, size: int, placed: bool) -> plan.MemoryPlan:
    flags = ["--device-memory", memory, "--tp", str(size), *(["--expert-parallel"] * placed)]
    args = build_parser().parse_args(["gpu-service", "plan", str(MODELS / model), *flags])
    return plan.from_args(args, torch.device("cpu"), False)


def _routed_fp8_bytes(model: str) -> int:
    """The routed experts' FP8 bytes of every layer and the MTP layer: a byte a weight."""
    cfg = plan.load_config(MODELS / model)
    layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    return layers * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size


# Slow: builds Qwen3.5-397B-A17B's rank-0 shard on the meta device.
@pytest.mark.slow
def test_397b_fp8_at_ep_8_holds_64_whole_experts_a_rank_and_fits_h200s() -> None:
    made = _plan("qwen3.5-397b-a17b-fp8", H200, 8, True)
    assert made.fits and made.expert_parallel and made.experts_per_rank == 512 // 8
    share = _routed_fp8_bytes("qwen3.5-397b-a17b-fp8") // 8
    # Their scales (a 16384th) and column groups beside them.
    assert share < made.expert_bytes < 1.001 * share
    cfg = plan.load_config(MODELS / "qwen3.5-397b-a17b-fp8")
    rows = made.svc.max_prefill_tokens
    assert made.parts["workspace_bytes"] >= exchange_bytes(cfg, rows, 2)
    report = plan_report.report(made)
    assert "per rank x 8 ranks (a device each), experts placed (64 a rank)" in report
    assert "64 experts whole a rank (rank r: ids 64r to 64r + 63)" in report
    body = plan_report.to_json(made)
    assert body["experts_per_rank"] == 64 and body["routed_expert_bytes"] == made.expert_bytes


# Slow: builds Qwen3.5-122B-A10B's rank-0 shard on the meta device, six times.
@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 4])
def test_122b_fp8_fits_h200s_and_h100s_with_and_without_ep(size: int) -> None:
    """Each rank holds E / N experts whole under EP, every expert's 1/N under TP: the same
    bytes within the column groups' few; EP's exchange buffers leave a little less KV; both
    fit 141 GB and 80 GB, the H100s at a shorter context."""
    model = "qwen3.5-122b-a10b-fp8"
    placed = {memory: _plan(model, memory, size, True) for memory in (H200, H100)}
    split = _plan(model, H200, size, False)
    assert all(p.fits for p in (*placed.values(), split))
    assert placed[H200].experts_per_rank == 256 // size and split.experts_per_rank == 256
    assert math.isclose(placed[H200].expert_bytes, split.expert_bytes, rel_tol=1e-3)
    share = _routed_fp8_bytes(model) // size
    assert share < placed[H200].expert_bytes < 1.001 * share
    assert placed[H200].svc.max_context < split.svc.max_context
    assert placed[H100].svc.max_context < placed[H200].svc.max_context
    for p in placed.values():
        positions = p.svc.num_kv_blocks * KEY_BLOCK
        assert positions >= p.svc.max_context and p.total <= p.memory.bytes


# Slow: builds Qwen3.5-122B-A10B's rank-0 shard on the meta device, three times.
@pytest.mark.slow
def test_122b_bf16_needs_four_h100s_and_fits_two_h200s() -> None:
    """245 GB of bf16: two H200s hold it (with a short context), two H100s do not, and the plan
    names four, where EP fits too."""
    model = "qwen3.5-122b-a10b"
    two_h100 = _plan(model, H100, 2, True)
    assert two_h100.fits is False and two_h100.parts["weights_bytes"] > 80 * 10**9
    args = build_parser().parse_args(
        ["gpu-service", "plan", str(MODELS / model), "--device-memory", H100, "--tp", "2"]
        + ["--expert-parallel"]
    )
    found = plan_report.holding_size(args, two_h100, False)
    assert found is not None and found.tensor_parallel_size == 4 and found.expert_parallel
    assert found.experts_per_rank == 64 and found.fits
    assert _plan(model, H200, 2, True).fits
