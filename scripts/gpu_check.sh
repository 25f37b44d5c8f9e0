#!/usr/bin/env bash
# The device check (scripts/gpu_check/): the GPU service and control plane started on the GPU,
# greedy `none` and `mtp` generations compared, the circuit diff against the service, the same
# with the service over two GPUs (`--tensor-parallel-size 2`; skipped, saying so, with fewer),
# the kernel tests, one greedy step profiled; one JSON report (--out, default $OUT/gpu_check.json
# or ./gpu_check.json) and a summary. Runs from the checkout with no install. Without a GPU it
# says so and exits 0; `--cpu` runs the same checks, smaller, on the CPU.
#
# --wheels DIR (default: wheels/ at the checkout's root, when there) first installs the pinned
# packages a bare GPU machine lacks (scripts/gpu_requirements.txt, and the reference kernels of
# scripts/gpu_reference_requirements.txt; fetched by scripts/gpu_wheels.sh) with no index;
# --no-wheels skips that. Every other argument goes to the check (`--help`).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
wheels=""
if [[ -d "$root/wheels" ]]; then wheels="$root/wheels"; fi
args=()
while (($#)); do
  case "$1" in
    --wheels) wheels="${2:?--wheels needs a directory}"; shift 2 ;;
    --wheels=*) wheels="${1#*=}"; shift ;;
    --no-wheels) wheels=""; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
site=""
if [[ -n "$wheels" ]]; then
  if [[ ! -d "$wheels" ]]; then
    echo "gpu_check: --wheels $wheels is not a directory" >&2
    exit 2
  fi
  # A folder of its own, put on PYTHONPATH: the GPU machine's python3 is itself a venv, so its
  # user site is off and a nested venv's system site would lack its torch. --no-deps with the
  # pinned list installs exactly those packages, never torch or triton.
  site="${GPU_CHECK_SITE:-${TMPDIR:-/tmp}/met-gpu-check-site}"
  "$python" -m pip install -q --no-index --no-deps --no-cache-dir --upgrade \
    --find-links "$wheels" --target "$site" -r "$root/scripts/gpu_requirements.txt" \
    -r "$root/scripts/gpu_reference_requirements.txt"
fi
export PYTHONPATH="$root${site:+:$site}${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -m scripts.gpu_check ${args[@]+"${args[@]}"}
