"""Each check's section of the report, guarded so that one failure does not hide the others;
the report's header, and the lines printed as each check ends and once all have."""

from __future__ import annotations

import os
import platform
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from importlib import metadata

from scripts.gpu_check.settings import Settings

CHECKS = (
    "service",
    "circuit_diff",
    "tp",
    "kernel_tests",
    "profile",
    "host_syncs",
    "graphs",
    "gemm",
    "references",
    "bench",
    "moe",
    "fp8",
    "compiled",
)


def guarded(check: Callable[[], dict]) -> dict:
    """The check's section (`ok`, `summary`, its figures) and its seconds; an exception
    becomes a failed section that carries it."""
    t0 = time.perf_counter()
    try:
        section = check()
    except Exception as e:
        section = failure(e)
    section["seconds"] = round(time.perf_counter() - t0, 2)
    return section


def failure(e: Exception) -> dict:
    """A failed section for the exception being handled."""
    return {
        "ok": False,
        "summary": f"{type(e).__name__}: {e}",
        "error": traceback.format_exc(limit=-8),
    }


def _version(package: str) -> str | None:
    # Read without importing: a Triton that fails to import is a check's finding, not a crash.
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict:
    return {
        "python": platform.python_version(),
        "torch": _version("torch"),
        "triton": _version("triton"),
        "triton_interpret": os.environ.get("TRITON_INTERPRET", ""),
    }


def settings_json(settings: Settings) -> dict:
    return {k: str(v) if k in ("out", "model") else v for k, v in asdict(settings).items()}


def overall(report: dict) -> bool:
    return all(report.get(name, {}).get("ok") is True for name in CHECKS)


def line(name: str, section: dict) -> str:
    mark = "skip" if section.get("skipped") else "ok" if section["ok"] else "FAIL"
    return f"  {name:13} {mark:4} {section['seconds']:7.1f} s  {section['summary']}"


def headline(report: dict) -> str:
    v = report["versions"]
    return (
        f"gpu_check on {report['device']} (forward {report['forward']}, torch {v['torch']}, "
        f"triton {v['triton']}): {'ok' if report['ok'] else 'FAILED'} in "
        f"{report['seconds']:.0f} s"
    )
