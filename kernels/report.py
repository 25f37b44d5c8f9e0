"""`python -m kernels.report`: the kernel report (`tools/kernel_report.py`) under the name the
kernels' users look for. It runs the module by name rather than importing it: the report builds
the model's forward, which sits above the kernels."""

from __future__ import annotations

import runpy

if __name__ == "__main__":
    runpy.run_module("tools.kernel_report", run_name="__main__", alter_sys=True)
