#!/usr/bin/env bash
# Lays out a CUDA 13 toolkit root (13.4, or 13.0: TINYLOOP_CUDA, below) in DIR from NVIDIA's PyPI wheels — no
# CUDA installer, no GPU, no driver — and prints the root's path on the last line of stdout. Every wheel unpacks
# under nvidia/cu13, so unzipping them into one folder merges them into one root.
#   scripts/cuda-root.sh DIR          nvcc and headers: enough for `cargo check --features cuda`
#                                     (candle-kernels compiles its PTX with nvcc): 130 MB of wheels, 340 MB on disk.
#   scripts/cuda-root.sh --link DIR   adds what a `--features cuda` build links against: cuBLAS, cuRAND, NVRTC
#                                     with their unversioned .so names, and a stub libcuda.so: 730 MB more, 1.2 GB in all.
# A DIR that already holds a complete root of these versions is reused as it is.
set -euo pipefail
link=0
if [ "${1:-}" = --link ]; then link=1; shift; fi
dir=${1:?usage: cuda-root.sh [--link] DIR}
# One CUDA release, TINYLOOP_CUDA: 13.4 (update 1, the default) — cudarc 0.19 has bindings up to 13.4, so a newer
# toolkit buys nothing — or 13.0, for an extension that runs on a CUDA 13.0 driver (580): a driver JIT-compiles
# candle's PTX only from a toolkit no newer than itself. nvidia-cuda-crt holds crt/host_config.h, which nvcc's own
# headers include; cccl is where CUDA 13 keeps the C++ headers (nvcc.profile puts include/cccl on the include path).
case ${TINYLOOP_CUDA:-13.4} in
13.4)
  base=(nvidia-cuda-nvcc==13.4.92 nvidia-cuda-runtime==13.4.92 nvidia-nvvm==13.4.92 nvidia-cuda-crt==13.4.92
    nvidia-cuda-cccl==13.3.4.3.1)
  libs=(nvidia-cuda-nvrtc==13.4.92 nvidia-cublas==13.8.0.4 nvidia-curand==10.4.4.72) ;;
13.0)
  base=(nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88
    nvidia-cuda-cccl==13.0.85)
  libs=(nvidia-cuda-nvrtc==13.0.88 nvidia-cublas==13.0.2.14 nvidia-curand==10.4.0.35) ;;
*) echo "TINYLOOP_CUDA must be 13.4 or 13.0" >&2; exit 2 ;;
esac
root=$dir/nvidia/cu13
mkdir -p "$dir"
exec 9>"$dir/.lock"
flock 9
# Each stamp names the exact set it was made from; a root from other pins is laid anew.
want=${base[*]}
if [ "$(cat "$dir/.base" 2>/dev/null)" != "$want" ] || ! [ -x "$root/bin/nvcc" ]; then
  rm -rf "$dir/nvidia" "$dir"/*.dist-info "$dir"/.base "$dir"/.libs*
fi
unpack() {  # stamp wheel...
  local stamp=$1 wheels=$dir/.wheels
  shift
  [ "$(cat "$dir/$stamp" 2>/dev/null)" = "$*" ] && return
  rm -rf "$wheels"
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$wheels" "$@" >&2
  for w in "$wheels"/*.whl; do unzip -qo "$w" -d "$dir"; done
  rm -rf "$wheels"
  echo "$*" >"$dir/$stamp"
}
unpack .base "${base[@]}"
if [ "$link" = 1 ] && [ "$(cat "$dir/.libs" 2>/dev/null)" != "${libs[*]}" ]; then
  rm -f "$dir/.libs"
  unpack .libs.tmp "${libs[@]}"
  # The wheels ship only the sonames (libcublas.so.13); the linker's -lcublas wants libcublas.so.
  for so in "$root"/lib/lib*.so.*; do
    name=${so##*/}
    ln -sf "$name" "$root/lib/${name%%.so.*}.so"
  done
  # libcuda comes with the GPU's driver, not the toolkit, and no wheel has the toolkit's stub of it. This
  # stub, like that one, only exports the driver API's symbols under the driver's soname libcuda.so.1: every
  # CUresult function that cuda.h declares, under the names its macros give them (cuMemAlloc_v2), and the
  # profiler calls, which cudarc binds too but whose header is in another wheel.
  mkdir -p "$root/lib/stubs"
  { echo '#include <cuda.h>' | cc -E -P -I"$root/include" -x c - | tr '\n' ' ' |
      grep -oE '\bCUresult +cu[A-Za-z0-9_]+ *\(' | sed -E 's/CUresult +//; s/ *\(//'
    printf '%s\n' cuProfilerInitialize cuProfilerStart cuProfilerStop; } | sort -u |
    sed 's/.*/void &(void) {}/' | cc -shared -fPIC -x c - -Wl,-soname,libcuda.so.1 -o "$root/lib/stubs/libcuda.so"
  mv "$dir/.libs.tmp" "$dir/.libs"
fi
"$root/bin/nvcc" --version >&2
echo "$root"
