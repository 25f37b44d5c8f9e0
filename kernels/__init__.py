"""Kernels: one folder per operator, `naive.py` (plain torch, the eager forward) beside each
Triton kernel file."""

import os


def configure_interpreter(device_type: str) -> None:
    """Run the Triton kernels in Triton's interpreter unless they run on CUDA. Triton reads
    `TRITON_INTERPRET` as each kernel is decorated, so a process calls this once at start,
    before any kernel module imports triton; a value the user set is kept."""
    if device_type != "cuda":
        os.environ.setdefault("TRITON_INTERPRET", "1")
