#!/usr/bin/env bash
# The first command on a new GPU node: builds the real-width fixture and runs every CUDA path of the tool, each
# step time-boxed (the kernel bench, pytest's GPU tests, convert RTN on the CPU and its refusal on cuda, GPTQ and
# calibrate-kv on cuda, check, the disk floor, two NCCL ranks where two GPUs exist), then prints one table.
# About 6 minutes on one H200 (budget 8). Offline; from a checkout with the project installed or on PYTHONPATH.
#
#   scripts/gpu_check.sh [--out DIR] [--budget-s 480] [--skip kernels pytest ...]
#
# QUANTIZE_WHEELS=DIR: wheels to install first into a temporary folder put on PYTHONPATH (a bare GPU image
# that lacks compressed-tensors, llmcompressor, pydantic, loguru or datasets and cannot reach an index).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -n "${QUANTIZE_WHEELS:-}" ]; then
  site=$(mktemp -d /tmp/quantize-site.XXXXXX)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$QUANTIZE_WHEELS"/*.whl \
    || { echo "gpu_check: installing the wheels in $QUANTIZE_WHEELS failed" >&2; exit 1; }
  export PYTHONPATH="$site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
exec python3 scripts/gpu_check.py "$@"
