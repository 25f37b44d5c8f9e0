"""`met bench --quick` as a smoke test: it runs end to end and the three methods agree; the
replicas section on the tiny checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from control_plane.benchmarks.replicas import replicas
from control_plane.benchmarks.report import replicas_lines
from control_plane.benchmarks.workload import Workload


def test_bench_quick(tmp_path: Path) -> None:
    """On the bundled checkpoint and its held-out prompts, as a user runs it."""
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "control_plane.cli",
            "bench",
            "--quick",
            "--out",
            str(out),
            "--markdown",
            str(tmp_path / "bench.md"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["failures"] == []
    assert {r["method"] for r in report["methods"]} == {
        "none",
        "mtp",
        "mtp_measured",
        "prompt_lookup",
    }
    assert all(r["identical"] for r in report["methods"])
    assert report["model"] == "default"
    mtp = next(r for r in report["methods"] if r["method"] == "mtp" and r["concurrency"] == 1)
    assert mtp["accepted_length"] > 1.5, "the trained drafter's drafts stand"
    assert report["memory"]["tiered_bytes"] < report["memory"]["full_capacity_bytes"]
    assert {(r["method"], r["concurrency"]) for r in report["split"]} == {("none", 1), ("mtp", 1)}
    for r in report["split"]:
        arms = ("in_process", "in_process_unpipelined", "grpc", "grpc_unpipelined")
        assert all(r[f"{a}_tok_s"] > 0 and r[f"{a}_step_ms"] > 0 for a in arms)
        assert r["in_process_plans"] > 0 and r["grpc_plans"] > 0, "the pipeline ran"
        assert r["in_process_unpipelined_plans"] == 0 and r["grpc_unpipelined_plans"] == 0
        assert 0 <= r["grpc_idle"] <= 1 and 0 <= r["in_process_idle"] <= 1
        assert r["grpc_over_in_process"] > 0 and r["grpc_over_in_process_unpipelined"] > 0
    assert [r["concurrency"] for r in report["speedup"]] == [1]
    chart = out.with_suffix(".png")
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "mtp / none at 1" in result.stdout
    assert "split mtp  at 1: pipelined" in result.stdout
    table = (tmp_path / "bench.md").read_text()
    assert "| mtp | 1 |" in table and "| prompt_lookup | 4 |" in table
    assert "service idle between steps (gRPC, pipelined)" in table


def test_replicas_bench_rows(tiny_dir: Path) -> None:
    """Every arm of the replicas section serves the same requests to the same tokens, and a
    router over two services puts requests on both."""
    work = Workload(tiny_dir)
    (row,) = replicas(tiny_dir, work, concurrency=[2], tokens=4, repeats=1, count=2)
    assert row["method"] == "mtp" and row["concurrency"] == 2 and row["replicas"] == 2
    assert all(row[f"{arm}_tok_s"] > 0 for arm in ("single", "router_1", "router_n"))
    assert row["router_1_over_single"] > 0 and row["router_n_over_router_1"] > 0
    assert row["requests_by_replica"] == [1, 1]
    assert row["identical"]
    assert row["single_submit_us"] > 0 and row["router_1_submit_us"] > 0
    lines = replicas_lines([row])
    assert "us through the router" in lines[0]
    assert lines[0].startswith("replicas mtp at 2: single") and "routing, not scaling" in lines[1]
