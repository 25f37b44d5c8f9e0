"""`tests/kernels` under pytest on the check's device: the tests pick CUDA when torch sees it,
else the interpreter, which this process has already chosen for its children."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from scripts.gpu_check.settings import ROOT, Settings

TIMEOUT_S = 900.0


def _counts(junit: Path) -> dict[str, int]:
    """Totals from pytest's JUnit XML: tests, failures, errors, skipped, passed."""
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    keys = ("tests", "failures", "errors", "skipped")
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in keys}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def _env(settings: Settings) -> dict[str, str]:
    # `--cpu` on a machine with a GPU: hide it, so the tests run on the CPU too.
    hidden = {"CUDA_VISIBLE_DEVICES": ""} if settings.device == "cpu" else {}
    return {**os.environ, **hidden}


def check_kernel_tests(settings: Settings) -> dict:
    selection = ["-k", settings.kernel_tests] if settings.kernel_tests else []
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        # The repository's conftest starts services; the kernel tests need none of it.
        cmd = [sys.executable, "-m", "pytest", "-q", "--noconftest", "-p", "no:cacheprovider"]
        cmd += [f"--junitxml={junit}", *selection, str(ROOT / "tests" / "kernels")]
        proc = subprocess.run(
            cmd, cwd=ROOT, env=_env(settings), capture_output=True, text=True, timeout=TIMEOUT_S
        )
        counts = _counts(junit) if junit.exists() else {}
    ok = proc.returncode == 0 and counts.get("passed", 0) > 0
    section = {
        "ok": ok,
        "summary": f"{counts.get('passed', 0)} of {counts.get('tests', 0)} passed"
        + (f" (-k {settings.kernel_tests!r})" if settings.kernel_tests else ""),
        "selection": settings.kernel_tests or "all",
        "returncode": proc.returncode,
        **counts,
    }
    if not ok:
        section["output"] = (proc.stdout + proc.stderr)[-4000:]
    return section
