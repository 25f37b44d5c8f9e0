"""Every kernel of the triton forward compiled for a GPU on this CPU
(`python -m tools.kernel_report`):
no spills and shared memory within a block's (227 KB on sm_90 and sm_100, 163 KB on sm_80) at
the flagship's shapes for sm_90 (its FP8 checkpoint's own kernels for sm_90 and sm_100) and at
the default model's for sm_80, sm_90 and sm_100, and enough programs at one sequence to fill an
H200's 132 SMs where the issue asks for them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.attention import splits
from tests.flagship import QWEN3_NEXT_80B
from tools.kernel_report import ROOT, problems

SMS = 132  # an H100's or H200's streaming multiprocessors
# The FP8 checkpoint's own kernels: the block-scaled GEMM, its activation quantizer (past one
# row tile), and the fused MoE's FP8 pair; the rest are the bf16 flagship's, checked there.
FP8_KERNELS = ("_fp8_matmul_kernel", "_quantize_kernel", "_gate_up_fp8_kernel", "_down_fp8_kernel")


def _report(tmp: Path, name: str, *args: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "tools.kernel_report", "--jobs", "1", "--json", str(tmp / name)]
    return subprocess.Popen(
        [*cmd, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Both reports, built side by side (a compile takes about a second of one core)."""
    tmp = tmp_path_factory.mktemp("report")
    runs = {
        "flagship": _report(
            tmp,
            "flagship.json",
            "--target",
            "sm_90",
            "--shapes",
            "qwen3-next-80b",
            "--batches",
            "1",
        ),
        "default": _report(
            tmp,
            "default.json",
            "--target",
            "sm_80,sm_90,sm_100",
            "--shapes",
            "default",
            "--batches",
            "8",
        ),
        "fp8": _report(
            tmp,
            "fp8.json",
            "--target",
            "sm_90,sm_100",
            "--shapes",
            "qwen3-next-80b-fp8",
            "--batches",
            "8",
            "--kernels",
            ",".join(FP8_KERNELS),
        ),
    }
    out = {}
    for name, run in runs.items():
        text, _ = run.communicate(timeout=600)
        assert run.returncode == 0, text[-3000:]
        out[name] = json.loads((tmp / f"{name}.json").read_text())
    return out


@pytest.mark.parametrize("which", ["flagship", "default", "fp8"])
def test_no_spills_and_shared_within_a_block(reports: dict[str, dict], which: str) -> None:
    report = reports[which]
    (shape,) = report["shapes"].values()
    kernels = {v["kernel"] for v in shape["variants"]}
    if which == "fp8":  # at sm_90 and sm_100, the GPUs with FP8 tensor cores
        assert kernels == set(FP8_KERNELS), kernels
        failures = problems(report)
        assert not failures, "\n".join(failures)
        return
    # Every kernel the triton forward launches at these shapes (the drafter's and the fold's
    # included): a kernel the forward stopped reaching would drop out of the check unseen.
    assert {
        "_argmax_kernel",
        "_chunk_kernel",
        "_conv_kernel",
        "_gather_rows",
        "_matmul_kernel",
        "_recurrent_kernel",
        "_rms_norm_kernel",
    } <= kernels, kernels
    if which == "flagship":
        assert {"_gate_up_kernel", "_down_kernel"} <= kernels
    failures = problems(report)
    assert not failures, "\n".join(failures)


def _programs(report: dict, phase: str, kernel: str, **sizes: int) -> list[int]:
    (shape,) = report["shapes"].values()
    return [
        launch["programs"]
        for launch in shape["launches"]
        if launch["phase"] == phase
        and launch["batch"] == 1
        and launch["kernel"] == kernel
        and all(launch["sizes"].get(k) == v for k, v in sizes.items())
    ]


@pytest.mark.parametrize("phase", ["decode", "verify"])
def test_one_sequence_fills_the_gpu(reports: dict[str, dict], phase: str) -> None:
    """At one sequence on the flagship's shapes: the GDN recurrent kernel at least one program
    an SM, the GEMM at N = 2048 at least half as many."""
    report = reports["flagship"]
    recurrent = _programs(report, phase, "_recurrent_kernel")
    assert recurrent and min(recurrent) >= SMS, recurrent
    gemm = _programs(report, phase, "_matmul_kernel", N=2048)
    assert gemm and min(gemm) >= SMS // 2, gemm


def test_attention_over_32k_keys_fills_the_gpu(reports: dict[str, dict]) -> None:
    """A decode row over 32,768 keys splits them over enough programs for every SM, by the
    kernel's own rule, and the report's decode at one sequence launches them all."""
    heads = QWEN3_NEXT_80B["num_attention_heads"]
    working = heads * splits.num_splits(32768)
    assert working >= SMS, working
    launched = _programs(reports["flagship"], "decode", "_split_kernel")
    assert launched and min(launched) >= working, launched
