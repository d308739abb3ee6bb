#!/usr/bin/env bash
# The Rust crate's tests for aarch64 (ARMv8-A: the NEON kernels), cross-compiled and run under qemu-aarch64.
# Needs the aarch64 Rust target and Debian's cross gcc and qemu-user:
#   rustup target add aarch64-unknown-linux-gnu
#   apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user
# TINYLOOP_ISA=scalar runs them at the portable level.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"
cargo test --release --target aarch64-unknown-linux-gnu "$@"
