"""`python -m kernels.report` is the kernel report: its flags, and its refusal of a bad one."""

from __future__ import annotations

import subprocess
import sys


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kernels.report", *args], capture_output=True, text=True, timeout=120
    )


def test_it_is_the_kernel_report() -> None:
    done = _run("--help")
    assert done.returncode == 0, done.stderr
    assert "--tensor-parallel-size" in done.stdout and "--expert-parallel" in done.stdout


def test_a_bad_flag_is_refused_by_the_report() -> None:
    done = _run("--no-such-flag")
    assert done.returncode == 2 and "unrecognized arguments: --no-such-flag" in done.stderr
