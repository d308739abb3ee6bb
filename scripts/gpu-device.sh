#!/usr/bin/env bash
# The GPU check on the device machine (scripts/gpu-check.sh prepares target/gpu-carry here first): it fails in its
# first seconds, naming what is missing, unless the GPU, torch, transformers, the CUDA libraries torch brings and the
# carried extension are all there; then scripts/gpu_check.py checks and measures, within 7 minutes, into $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
carry=target/gpu-carry
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out"
for f in "$carry"/_core*.so "$carry/refs.json"; do [ -e "$f" ] || { echo "missing $f: run scripts/gpu-check.sh here" >&2; exit 3; }; done
python3 -c 'import torch, transformers, numpy, safetensors; assert torch.cuda.is_available(), "torch sees no GPU"' ||
  { echo "the device lacks torch with CUDA, transformers, numpy or safetensors" >&2; exit 3; }
# The extension links the CUDA 13 runtime, cuBLAS(Lt), cuRAND and NVRTC: torch's nvidia-* wheels hold them.
site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
libs=$(find "$site/nvidia" -maxdepth 3 -type d -name lib 2>/dev/null | tr '\n' :)
export LD_LIBRARY_PATH=$libs${LD_LIBRARY_PATH:-}
python3 -m pip install -q --no-index --no-deps --target "$carry/py" "$carry"/wheels/*.whl
cp "$carry"/_core*.so python/tinyloop/
export PYTHONPATH=$PWD/python:$PWD/$carry/py
python3 -c 'import tinyloop; print("tinyloop on", tinyloop._core.check_device("cuda"))' ||
  { echo "the CUDA extension does not load or sees no GPU (libraries on LD_LIBRARY_PATH: $libs)" >&2; exit 3; }
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$out/nvidia-smi.csv"
fi
timeout 450 python3 scripts/gpu_check.py device --refs "$carry/refs.json" --out "$out/gpu.json" --budget 380 2>&1 |
  tee "$out/log.txt"
