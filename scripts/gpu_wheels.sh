#!/usr/bin/env bash
# Download, here, the wheels scripts/gpu_check.sh --wheels installs on a GPU machine that
# cannot reach an index: scripts/gpu_requirements.txt and gpu_reference_requirements.txt for
# CPython 3.12 on manylinux x86_64, into wheels/ at the checkout's root (or $1). Needs the
# network; never run by the tests.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="${1:-$root/wheels}"
# pip matches each platform tag exactly; wheels name glibc floors from 2.17 up (llguidance's
# is 2.31), and the GPU machine's glibc is newer than all of these.
platforms=(--platform manylinux2014_x86_64)
for n in $(seq 17 39); do
  platforms+=(--platform "manylinux_2_${n}_x86_64")
done
"${PYTHON:-python3}" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d "$dest" -r "$root/scripts/gpu_requirements.txt" \
  -r "$root/scripts/gpu_reference_requirements.txt"
echo "wheels in $dest; carry it and run scripts/gpu_check.sh --wheels $dest"
