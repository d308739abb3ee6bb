#!/usr/bin/env bash
# Builds the aarch64 abi3 manylinux_2_28 wheel (maturin with zig), installs it for an aarch64 CPython 3.11 taken
# from Debian's arm64 packages, and runs it under qemu-aarch64: the shipped default model (F16, the dense NEON body)
# and its Q4_0 quantization (the SDOT body) at each aarch64 level must give this machine's greedy tokens, and
# log-probabilities within 2e-3 — 3e-2 for Q4_0 at `scalar`, which runs candle's own Q4_0 dot products, whose
# arithmetic differs from the ggml-exact one of tinyloop's kernels (measured 1.3e-2). Needs root for apt (it adds Debian's arm64 architecture), Debian's qemu-user, and
# the aarch64 Rust target (`rustup target add aarch64-unknown-linux-gnu`). WORK (default /tmp/tinyloop-aarch64)
# holds the sysroot, the wheel and the aarch64 packages.
set -euo pipefail
cd "$(dirname "$0")/.."
work=${WORK:-/tmp/tinyloop-aarch64}
mkdir -p "$work/debs" "$work/root/lib" "$work/wheels"
python3 -m pip install -q ziglang 'maturin>=1.5,<2'
python3 -m maturin build --release --zig --target aarch64-unknown-linux-gnu --compatibility manylinux_2_28 \
  -o "$work/wheels"
wheel=$(ls -t "$work"/wheels/tinyloop-*-cp311-abi3-manylinux_2_28_aarch64.whl | head -n 1)

# An aarch64 CPython 3.11 and the libraries it loads, unpacked from Debian's arm64 packages into a sysroot.
dpkg --print-foreign-architectures | grep -qx arm64 || dpkg --add-architecture arm64
apt-get update -qq
(cd "$work/debs" && apt-get download -qq python3.11-minimal:arm64 libpython3.11-minimal:arm64 \
  libpython3.11-stdlib:arm64 zlib1g:arm64 libexpat1:arm64 libffi8:arm64 libssl3:arm64 libbz2-1.0:arm64 \
  liblzma5:arm64 libgcc-s1:arm64 libstdc++6:arm64 libc6:arm64 libcrypt1:arm64)
for deb in "$work"/debs/*.deb; do dpkg -x "$deb" "$work/root"; done
python3 -m pip install -q --target "$work/site" --upgrade --no-deps --only-binary=:all: --python-version 3.11 \
  --implementation cp --platform manylinux_2_28_aarch64 --platform manylinux2014_aarch64 \
  numpy gguf tqdm pyyaml "$wheel"

# This machine's answers, then the aarch64 wheel's at each level.
check='
import json, sys, tinyloop
from tinyloop import SamplingParams
engine = tinyloop.Engine(sys.argv[1])
ids = engine.encode("Once upon a time there was a little dog who ran to the park")
greedy = engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=12), loops=8).tokens
print(json.dumps({"isa": tinyloop._core.isa(), "scores": engine.score(ids, [1, 8]), "greedy": greedy}))
'
default=$(python3 -c 'import tinyloop, pathlib; print(pathlib.Path(tinyloop.__file__).parent / "models" / "default.tinyloop")')
q4="$work/default-q4_0.tinyloop"
[ -f "$q4" ] || python3 -m tinyloop quantize "$default" "$q4" --bits 4
cp "$default" "$work/default.tinyloop"
for model in "$work/default.tinyloop" "$q4"; do
  python3 -c "$check" "$model" > "$work/host.json"
  for level in neon scalar; do
    TINYLOOP_ISA=$level PYTHONPATH="$work/site" qemu-aarch64 -L "$work/root" "$work/root/usr/bin/python3.11" \
      -c "$check" "$model" > "$work/arm.json"
    tolerance=2e-3
    [ "$model" = "$q4" ] && [ "$level" = scalar ] && tolerance=3e-2
    python3 - "$work/host.json" "$work/arm.json" "$model" "$tolerance" <<'PY'
import json, sys
host, arm = (json.load(open(p)) for p in sys.argv[1:3])
assert arm["greedy"] == host["greedy"], (arm["greedy"], host["greedy"])
gap = max(abs(a - b) for (la, _), (lb, _) in zip(arm["scores"], host["scores"], strict=True) for a, b in zip(la, lb))
assert gap < float(sys.argv[4]), gap
print(f"{sys.argv[3]}: aarch64 {arm['isa']} = host {host['isa']} (greedy tokens equal, log-probs within {gap:.1e})")
PY
  done
done
