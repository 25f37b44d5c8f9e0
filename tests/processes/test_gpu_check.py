"""scripts/gpu_check.sh: `--cpu` runs every check on the CPU and writes one report (the
tensor-parallel section over two CPU processes); without a GPU and without `--cpu` it says so
and exits 0; with fewer than two GPUs the tensor-parallel section says it skipped; the wheels
it installs on a GPU machine carry the pins of pyproject.toml."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

from scripts.gpu_check import tp as tp_check
from scripts.gpu_check.report import CHECKS, line
from scripts.gpu_check.settings import CPU, GPU

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _run(*args: str, timeout: float, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "OUT"}
    environ |= {"PYTHON": sys.executable, **env}
    return subprocess.run(
        [str(SCRIPT), *args], capture_output=True, text=True, env=environ, timeout=timeout
    )


# Slow: runs the device check.
@pytest.mark.slow
def test_cpu_run_writes_a_passing_report(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    done = _run("--no-wheels", "--cpu", "--out", str(out), timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    report = json.loads(out.read_text())
    failed = {name: report[name].get("summary") for name in CHECKS if not report[name]["ok"]}
    assert report["ok"] and not failed, failed
    assert report["device"] == "cpu" and report["forward"] == "eager"

    service = report["service"]
    assert service["device"] == "cpu"
    assert service["none"] == service["mtp"] and service["identical"]
    assert [len(t) for t in service["none"]] == [CPU.max_new_tokens] * len(CPU.prompts)
    assert service["drafted"] > 0, "mtp drafted nothing: the comparison proves nothing"
    assert service["exit_status"] == {"control_plane": 0, "gpu_service": 0}

    for run in ("verify", "mtp"):
        diff = report["circuit_diff"][run]
        assert diff["verdict"] == "PASS" and diff["device"] == "cpu", diff
        assert diff["args"][-6:] == ["--widths", "2", "--ks", "2,3", "--steps", "2"]
    assert "--mtp" in report["circuit_diff"]["mtp"]["args"]

    tp = report["tp"]  # no CUDA devices under --cpu: skipped, and said so
    assert tp["ok"] and tp["skipped"] and "(--cpu)" in tp["summary"], tp

    kernels = report["kernel_tests"]
    assert kernels["passed"] == kernels["tests"] > 0

    batches = report["profile"]["batches"]
    assert set(batches) == {str(b) for b in CPU.profile_batches}
    for b in batches.values():
        assert b["launches"] > 0 and b["ms_per_step"] > 0
    assert report["host_syncs"]["syncs"] is None

    graphs = report["graphs"]
    assert graphs["identical"] and graphs["replays"] > 0 and graphs["captured"] > 0
    assert set(graphs["on"]) == set(graphs["off"]) == {str(b) for b in CPU.profile_batches}
    gemm = report["gemm"]
    assert gemm["variant_rows"] and not any(gemm["variant_rows"].values())
    for shape in gemm["speed"].values():
        assert set(shape) == {str(m) for m in CPU.gemm_speed_rows}
    assert report["references"]["gdn"] is None, "timed on a GPU only"
    assert "GPU only" in report["bench"]["summary"]
    moe = report["moe"]
    assert list(moe["shape"].values()) == list(CPU.moe_shape)
    assert set(moe["rows"]) == {str(p) for p in CPU.moe_rows}
    for r in moe["rows"].values():
        assert r["within_tolerance"] and r["max_abs_diff"] <= moe["tolerance"], r
        assert r["fused_ms"] > 0 and r["routed_ms"] > 0 and r["experts_hit"] > 0
    assert "circuit_diff  ok" in done.stdout and str(out) in done.stdout


def test_without_a_gpu_it_says_so(tmp_path: Path) -> None:
    done = _run(
        "--no-wheels", "--out", str(tmp_path / "r.json"), timeout=120, CUDA_VISIBLE_DEVICES=""
    )
    assert done.returncode == 0 and "no CUDA GPU" in done.stdout, done.stderr
    missing = _run("--wheels", str(tmp_path / "none"), "--cpu", timeout=30)
    assert missing.returncode == 2 and "not a directory" in missing.stderr


def test_tp_is_skipped_with_fewer_than_two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tp_check, "_cuda_devices", lambda: 1)
    section = tp_check.check_tp(GPU)
    assert section["ok"] and section["skipped"] and section["cuda_devices"] == 1
    assert section["summary"] == "skipped: TP 2 needs 2 CUDA devices, this machine has 1"
    assert " skip " in line("tp", {**section, "seconds": 0.0})


def test_tp_runs_again_with_the_experts_placed(monkeypatch: pytest.MonkeyPatch) -> None:
    """With two GPUs the section serves the bundled model at TP 2, then a routed-MoE
    checkpoint at TP 2 with `--expert-parallel`, whose experts two ranks can place."""
    from gpu_service.model import shard
    from gpu_service.model.config import ModelConfig

    runs = []

    def served(settings, *flags: str) -> dict[str, dict]:
        cfg = ModelConfig.load(settings.model)
        if "--expert-parallel" in flags:
            shard.check(cfg, 2, experts=True)
        runs.append((cfg.num_experts, flags))
        service = {"ok": True, "summary": "tokens match", "tensor_parallel_size": 2}
        return {"service": service, "circuit_diff": {"ok": True, "summary": "PASS"}}

    monkeypatch.setattr(tp_check, "_cuda_devices", lambda: 2)
    monkeypatch.setattr(tp_check, "served_checks", served)
    section = tp_check.check_tp(GPU)
    flags = ("--tensor-parallel-size", "2")
    assert runs == [(0, flags), (tp_check.MOE_EXPERTS, (*flags, "--expert-parallel"))]
    assert section["ok"] and section["expert_parallel"]["ok"] and not section["skipped"]
    assert "TP 2 + EP: tokens match; diff PASS" in section["summary"]


def _pins(lines: list[str]) -> dict[str, str]:
    pairs = (line.split("==") for line in lines if "==" in line and not line.startswith("#"))
    # PEP 503 names: `prometheus_client` and `prometheus-client` are one project.
    return {re.sub(r"[-_.]+", "-", n.strip()).lower(): v.strip() for n, v in pairs}


def test_gpu_wheels_carry_the_pins() -> None:
    """Each wheel the GPU machine installs is the version this checkout runs with."""
    wanted = _pins((ROOT / "scripts" / "gpu_requirements.txt").read_text().splitlines())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pinned = _pins(project["dependencies"])
    assert {"grpcio-health-checking", "llguidance", "tokenizers", "protobuf"} <= set(wanted)
    for name, version in wanted.items():
        assert pinned.get(name, version) == version, name
        assert metadata.version(name) == version, name


def test_reference_kernels_are_pinned_and_kept_out_of_this_environment() -> None:
    """fla travels to the GPU machine as wheels; installed here it would take over
    transformers' Qwen3-Next forward (the parity tests' reference) with kernels the CPU
    cannot run."""
    import importlib.util

    lines = (ROOT / "scripts" / "gpu_reference_requirements.txt").read_text().splitlines()
    pins = _pins(lines)
    assert "fla-core" in pins and all(pins.values())
    assert not any(x.strip() and not x.startswith("#") and "==" not in x for x in lines)
    assert importlib.util.find_spec("fla") is None
