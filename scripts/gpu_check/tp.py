"""The tensor-parallel section: the serving pair again, the GPU service over two ranks
(`--tensor-parallel-size 2`: cuda:0 and cuda:1); greedy `none` against `mtp` through it, the
circuit diff against it, and the tokens a second each method streams. A machine with fewer than
two CUDA devices, or a `--cpu` run, skips it and says so: on CPU processes the same checks run in
tests/gpu_service/tp/test_tensor_parallel.py."""

from __future__ import annotations

from scripts.gpu_check.service import served_checks
from scripts.gpu_check.settings import Settings

TP_SIZE = 2


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count()


def check_tp(settings: Settings) -> dict:
    count = _cuda_devices() if settings.device == "cuda" else 0
    if count < TP_SIZE:
        return {
            "ok": True,
            "skipped": True,
            "summary": f"skipped: TP {TP_SIZE} needs {TP_SIZE} CUDA devices, this machine has "
            f"{count}" + ("" if settings.device == "cuda" else " in use (--cpu)"),
            "cuda_devices": count,
        }
    sections = served_checks(settings, "--tensor-parallel-size", str(TP_SIZE))
    service, diff = sections["service"], sections["circuit_diff"]
    size = service.get("tensor_parallel_size")
    return {
        "ok": service["ok"] and diff["ok"] and size == TP_SIZE,
        "summary": f"TP {TP_SIZE}: {service['summary']}; diff {diff['summary']}",
        "skipped": False,
        "tensor_parallel_size": size,
        "tok_s": service.get("tok_s"),
        **sections,
    }
