#!/usr/bin/env bash
# The GPU check, prepared here: everything the device machine needs goes under target/gpu-carry (< 64 MiB, what the
# `device` tool carries beside the working tree), and then one command runs it there:
#   scripts/gpu-check.sh                 # here: build, check the carry installs, record the CPU engine's tokens
#   bash scripts/gpu-device.sh           # there, as the device tool's command with carry ["target/gpu-carry"]
#   python scripts/gpu_report.py RESULT  # here again: the result JSON into docs/gpu.md
# Built here: the extension with the cuda feature (the CUDA 13.0 toolkit from PyPI wheels, scripts/cuda-root.sh:
# the device's driver 580 is CUDA 13.0, and a driver compiles candle's PTX only from a toolkit no newer than itself),
# the pure-Python wheel the device lacks (gguf), and the CPU engine's greedy tokens (scripts/gpu_check.py refs).
# Cost on 2 cores: ~12 min the first time (candle's PTX, then the linked extension), a minute once warm.
set -euo pipefail
cd "$(dirname "$0")/.."
carry=target/gpu-carry
rm -rf "$carry" && mkdir -p "$carry/wheels"
root=$(TINYLOOP_CUDA=13.0 scripts/cuda-root.sh --link "${TINYLOOP_CUDA_LINK_ROOT:-$HOME/.cache/tinyloop-cuda-13.0}" | tail -n 1)
export CUDA_ROOT=$root CUDA_PATH=$root CUDA_HOME=$root PATH=$root/bin:$PATH CUDA_COMPUTE_CAP=90
export CUDARC_CUDA_VERSION=13000 CUDAFORGE_THREADS=${CUDAFORGE_THREADS:-$(nproc)}
export LIBRARY_PATH=$root/lib:$root/lib/stubs${LIBRARY_PATH:+:$LIBRARY_PATH}
CARGO_TARGET_DIR=target/cuda-13.0 maturin build --release --features cuda,python --auditwheel skip -o target/cuda-13.0/wheels
wheel=$(ls -t target/cuda-13.0/wheels/tinyloop-*.whl | head -n 1)
# Only the extension travels: the working tree already holds the Python package and the default model.
unzip -qjo "$wheel" 'tinyloop/_core*.so' -d "$carry"
python3 -m pip download -q --no-deps --only-binary=:all: -d "$carry/wheels" \
  "gguf==$(python3 -c 'import importlib.metadata as m; print(m.version("gguf"))')"
python3 -m pip install -q --no-index --no-deps --target "$carry/check" "$carry"/wheels/*.whl && rm -rf "$carry/check"
python3 scripts/gpu_check.py refs --out "$carry/refs.json"
du -sh "$carry"
