//! Bakes the git commit the extension is built from into `tinyloop._core.__commit__` (empty outside a checkout),
//! and sets `cfg(vnni)` when the target CPU has AVX-512 F/BW/VNNI (`.cargo/config.toml` builds for the native CPU),
//! which turns on tinyloop's own Q4_0 / Q8_0 kernel (rust/kernels/vnni.rs).
use std::process::Command;

fn main() {
    let commit = Command::new("git")
        .args(["rev-parse", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    println!("cargo:rustc-env=TINYLOOP_GIT_COMMIT={commit}");
    println!("cargo:rerun-if-changed=.git/HEAD");
    println!("cargo:rerun-if-changed=.git/refs/heads");
    println!("cargo::rustc-check-cfg=cfg(vnni)");
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let features = std::env::var("CARGO_CFG_TARGET_FEATURE").unwrap_or_default();
    let has = |f: &str| features.split(',').any(|x| x == f);
    if arch == "x86_64" && has("avx512f") && has("avx512bw") && has("avx512vnni") {
        println!("cargo:rustc-cfg=vnni");
    }
}
