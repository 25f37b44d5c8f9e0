"""`met bench --quick` as a smoke test: it runs end to end and the three methods agree."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_bench_quick(tiny_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "control_plane.cli",
            "bench",
            "--quick",
            "--model",
            str(tiny_dir),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["failures"] == []
    assert {r["method"] for r in report["methods"]} == {"none", "mtp", "prompt_lookup"}
    assert all(r["identical"] for r in report["methods"])
    assert report["memory"]["tiered_bytes"] < report["memory"]["full_capacity_bytes"]
    assert report["split"][0]["grpc_step_ms"] > 0
