#!/usr/bin/env bash
# Builds the binary wheel users install without a Rust toolchain — one abi3 wheel (every CPython >= 3.11) for
# manylinux_2_28 x86_64 (glibc 2.28 and later; maturin links against that glibc through zig) — then installs it
# with its test extra into a fresh virtual environment and runs pytest there with no Rust toolchain on PATH.
# Arguments go to pytest (default: the whole suite). WHEEL_DIR (default target/wheels) receives the wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${WHEEL_DIR:-target/wheels}
python3 -m pip install -q ziglang 'maturin>=1.5,<2'
python3 -m maturin build --release --zig --compatibility manylinux_2_28 -o "$out"
wheel=$(ls -t "$out"/tinyloop-*-cp311-abi3-manylinux_2_28_x86_64.whl | head -n 1)
venv=$(mktemp -d)/venv
python3 -m venv "$venv"
"$venv/bin/pip" install -q "$wheel[test]"
# The tests run against the installed wheel: no cargo, rustc or maturin reachable.
PATH=$(printf '%s' "$PATH" | tr ':' '\n' | grep -v -e '\.cargo' -e '\.pyenv' -e '\.rustup' | paste -s -d ':')
export PATH="$venv/bin:$PATH"
if command -v cargo || command -v rustc; then
  echo "a Rust toolchain is still on PATH" >&2
  exit 1
fi
python -c 'import tinyloop, sys; print(tinyloop.__file__, tinyloop._core.isa(), file=sys.stderr)'
python -m pytest -p no:cacheprovider "$@"
