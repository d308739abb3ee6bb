#!/usr/bin/env bash
# Type-checks the crate, all targets, with the cargo feature cuda on a machine with no GPU and no CUDA install,
# so that code behind that feature cannot break unseen. nvcc and the CUDA headers come from NVIDIA's PyPI
# wheels (scripts/cuda-root.sh), kept in TINYLOOP_CUDA_ROOT_CACHE (default ~/.cache/tinyloop-cuda, 340 MB).
# Nothing is linked or run. Fails when the Rust code, or candle's CUDA kernels under this toolkit, do not compile.
# Arguments: the feature sets to check, one cargo check each (default: cuda cuda,python).
# Cost on 2 cores: the root ~5 s (0 s once cached); each feature set 4-8 min the first time (12 min for both
# while other builds shared the cores), nearly all of it candle-kernels compiling its PTX. The two sets do not
# share that build: python's proc macros turn on syn's "full" feature, which changes the hash of
# candle-kernels' build script (its build-deps use syn through serde_derive). The build stays in
# TINYLOOP_CUDA_TARGET_DIR (default target/cuda, 0.6 GB), apart from the normal target dir; a rerun with it
# warm takes ~10 s. A later `cargo build` of the same features and target dir reuses the PTX.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || set -- cuda cuda,python
t=$SECONDS
root=$(scripts/cuda-root.sh "${TINYLOOP_CUDA_ROOT_CACHE:-$HOME/.cache/tinyloop-cuda}" | tail -n 1)
echo "cuda-check: CUDA root $root in $((SECONDS - t)) s" >&2
export CUDA_ROOT=$root CUDA_PATH=$root CUDA_HOME=$root PATH=$root/bin:$PATH
# With no GPU to ask (nvidia-smi), candle-kernels needs the compute capability to build its PTX for: Hopper.
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
# cudarc picks its bindings by this version (it knows CUDA up to 13.4); the root is 13.4 too.
export CUDARC_CUDA_VERSION=13040
# candle-kernels' nvcc runs use half the cores unless told (this does not invalidate its cached build).
export CUDAFORGE_THREADS=${CUDAFORGE_THREADS:-$(nproc)}
export CARGO_TARGET_DIR=${TINYLOOP_CUDA_TARGET_DIR:-target/cuda}
for features in "$@"; do
  t=$SECONDS
  cargo check --release --all-targets --features "$features"
  echo "cuda-check: cargo check --features $features in $((SECONDS - t)) s" >&2
done
