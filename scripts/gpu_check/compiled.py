"""What the kernels compile to, beside what they measured: `tools.kernel_report` for this device's
own architecture at the flagship's shapes (the figures the CPU-only machines commit in
docs/kernel_report.json), and, on a GPU, the registers and spills of every kernel this check
actually loaded, read from Triton's caches, with the times the speed and MoE sections
measured for the same kernels."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from scripts.gpu_check.settings import ROOT, Settings
from tools.kernel_report import KERNEL_MODULES

# The figures of the report's other sections that time each kernel (section, key).
MEASURED = {
    "_matmul_kernel": ("gemm", "speed"),
    "_recurrent_kernel": ("references", "gdn"),
    "_attention_kernel": ("references", "attention"),
    "_gate_up_kernel": ("moe", "rows"),
    "_down_kernel": ("moe", "rows"),
    "_fp8_matmul_kernel": ("fp8", "speed"),
}


def target_of(device: torch.device) -> str:
    """The report's target for a GPU (sm_90 for an H100 or H200); sm_90 on the CPU, the
    flagship's GPU."""
    if device.type != "cuda":
        return "sm_90"
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def loaded_kernels() -> dict[str, dict]:
    """Every compiled kernel in Triton's caches, by kernel name: the most registers and spill
    bytes and shared memory over its variants, as the driver loaded them. Empty under the
    interpreter, which compiles nothing."""
    from triton.runtime.jit import JITFunction

    out: dict[str, dict] = {}
    for name in KERNEL_MODULES:
        module = importlib.import_module(name)
        for fn in vars(module).values():
            if not isinstance(fn, JITFunction):
                continue
            for cache, *_ in fn.device_caches.values():
                for kernel in cache.values():
                    kernel._init_handles()
                    row = out.setdefault(
                        fn.__name__, {"variants": 0, "registers": 0, "spills": 0, "shared": 0}
                    )
                    row["variants"] += 1
                    row["registers"] = max(row["registers"], int(kernel.n_regs))
                    row["spills"] = max(row["spills"], int(kernel.n_spills))
                    row["shared"] = max(row["shared"], int(kernel.metadata.shared))
    return out


def _measured(report: dict, kernel: str) -> object:
    where = MEASURED.get(kernel)
    if where is None:
        return None
    section = report.get(where[0]) or {}
    return section.get(where[1])


def check_compiled(settings: Settings, device: torch.device, report: dict) -> dict:
    """The compile report for this device at the flagship's shapes (one batch of 1 and one of
    8 sequences under --cpu), beside the loaded kernels' figures and the measured times."""
    target = target_of(device)
    batches = "1,8,32" if device.type == "cuda" else "1"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "tools.kernel_report",
                "--target",
                target,
                "--shapes",
                "qwen3-next-80b",
                "--batches",
                batches,
                "--json",
                str(out),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=900,
        )
        if run.returncode != 0:
            raise RuntimeError(f"tools.kernel_report exited {run.returncode}: {run.stderr[-2000:]}")
        compiled = json.loads(out.read_text())
    shape = compiled["shapes"]["qwen3-next-80b"]
    loaded = loaded_kernels() if device.type == "cuda" else {}
    kernels: dict[str, dict] = {}
    for v in shape["variants"]:
        figures = v["targets"][target]
        row = kernels.setdefault(
            v["kernel"], {"variants": 0, "registers": 0, "spills": 0, "shared": 0}
        )
        row["variants"] += 1
        if "error" in figures:
            row["error"] = figures["error"]
            continue
        row["registers"] = max(row["registers"], figures["registers"])
        row["spills"] = max(row["spills"], figures["spill_bytes"] + figures["local_bytes"])
        row["shared"] = max(row["shared"], figures["shared_bytes"])
    for name, row in kernels.items():
        row["loaded_here"] = loaded.get(name)
        row["measured"] = _measured(report, name)
    bad = sorted(n for n, r in kernels.items() if r["spills"] or "error" in r)
    return {
        "ok": not bad,
        "summary": (
            f"{target} at qwen3-next-80b: {len(shape['variants'])} variants of "
            f"{len(kernels)} kernels, "
            + (f"spilling or failing: {', '.join(bad)}" if bad else "none spills")
            + (f"; {len(loaded)} kernels loaded here" if loaded else "")
        ),
        "target": target,
        "kernels": kernels,
        "launches": shape["launch_summary"],
    }
