#!/usr/bin/env bash
# On a machine with a CUDA GPU: the kernel tests on the device, the whole model under
# `triton` against `eager`, and each kernel's time against its torch reference. Runs from the
# checkout with no install (needs torch, triton, numpy, pytest). Without a GPU it says so and
# exits 0; `--cpu` runs the same checks under Triton's interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" scripts/gpu_check.py "$@"
