"""`python -m scripts.gpu_check` (scripts/gpu_check.sh sets up the path and the wheels)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from scripts.gpu_check.report import (
    failure,
    guarded,
    headline,
    line,
    overall,
    settings_json,
    versions,
)
from scripts.gpu_check.settings import Settings, parse_args

if TYPE_CHECKING:
    import torch

NO_GPU = (
    "gpu_check: no CUDA GPU on this machine; nothing to check (--cpu runs the same checks on "
    "the CPU)"
)


def _served(settings: Settings, device: torch.device) -> dict[str, dict]:
    from scripts.gpu_check.service import served_checks

    return served_checks(settings)


def _tp(settings: Settings, device: torch.device) -> dict[str, dict]:
    from scripts.gpu_check.tp import check_tp

    return {"tp": guarded(lambda: check_tp(settings))}


def _kernel_tests(settings: Settings, device: torch.device) -> dict[str, dict]:
    from scripts.gpu_check.kernel_tests import check_kernel_tests

    return {"kernel_tests": guarded(lambda: check_kernel_tests(settings))}


def _step(settings: Settings, device: torch.device) -> dict[str, dict]:
    from scripts.gpu_check.step import step_checks

    return step_checks(settings, device)


def _speed(settings: Settings, device: torch.device) -> dict[str, dict]:
    from scripts.gpu_check.speed import speed_checks

    return speed_checks(settings, device)


def _moe(settings: Settings, device: torch.device) -> dict[str, dict]:
    from scripts.gpu_check.moe import check_moe

    return {"moe": guarded(lambda: check_moe(settings, device))}


def _fp8(settings: Settings, device: torch.device) -> dict[str, dict]:
    from scripts.gpu_check.fp8 import check_fp8

    return {"fp8": guarded(lambda: check_fp8(settings, device))}


def _compiled(settings: Settings, device: torch.device, report: dict) -> dict[str, dict]:
    from scripts.gpu_check.compiled import check_compiled

    return {"compiled": guarded(lambda: check_compiled(settings, device, report))}


# In order; the services are stopped before the in-process engines load. The last stage reads
# what the others measured.
STAGES = (
    (("service", "circuit_diff"), _served),
    (("tp",), _tp),
    (("kernel_tests",), _kernel_tests),
    (("profile", "host_syncs"), _step),
    (("graphs", "gemm", "references", "bench"), _speed),
    (("moe",), _moe),
    (("fp8",), _fp8),
)
FINAL = (("compiled",), _compiled)


def _stage(names: tuple[str, ...], run: Callable[[], dict[str, dict]]) -> dict[str, dict]:
    """The stage's sections; a stage that cannot start (an import that fails) fails each."""
    t0 = time.perf_counter()
    try:
        return run()
    except Exception as e:
        seconds = round(time.perf_counter() - t0, 2)
        return {name: {**failure(e), "seconds": seconds} for name in names}


def run_checks(settings: Settings, device: torch.device, save: Callable[[dict], None]) -> dict:
    """Every stage in turn, the report saved after each: a run cut short keeps what it did."""
    from gpu_service.engine.device import describe_device

    t0 = time.perf_counter()
    report: dict = {
        "ok": False,
        "seconds": 0.0,
        "device": describe_device(device),
        "forward": settings.forward,
        "versions": versions(),
        "settings": settings_json(settings),
    }
    for names, run in STAGES:
        sections = _stage(names, lambda run=run: run(settings, device))
        for name, section in sections.items():
            print(line(name, section), flush=True)
        report |= sections
        report["seconds"] = round(time.perf_counter() - t0, 1)
        save(report)
    names, final = FINAL
    sections = _stage(names, lambda: final(settings, device, report))
    for name, section in sections.items():
        print(line(name, section), flush=True)
    report |= sections
    report["seconds"] = round(time.perf_counter() - t0, 1)
    report["ok"] = overall(report)
    save(report)
    return report


def main(argv: list[str] | None = None) -> int:
    settings = parse_args(argv)
    import torch

    if settings.device == "cuda" and not torch.cuda.is_available():
        print(NO_GPU)
        return 0
    from gpu_service.engine.device import choose_device, default_forward

    # Before anything imports a kernel: the Triton interpreter decision for this process and
    # its children (the kernel tests).
    device = choose_device(settings.device)
    settings = replace(
        settings, device=device.type, forward=settings.forward or default_forward(device)
    )
    settings.out.parent.mkdir(parents=True, exist_ok=True)
    report = run_checks(
        settings, device, lambda r: settings.out.write_text(json.dumps(r, indent=2) + "\n")
    )
    print(headline(report))
    print(f"report: {settings.out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
