//! tinyloop's own compute kernels: the panel-packed matmuls (`dense` for F16/F32 weights, `blockq` for Q4_0/Q8_0 with
//! AVX-512 VNNI, AVX2 or NEON's dot product) over the shared driver in `panels`, blocked f16 attention (`attn_f16`), and 16-lane vector
//! math (`simd`); `isa` picks, when a kernel first asks, which of their bodies run. The items every kernel
//! shares are defined here; this module imports none of its children.

#[cfg(target_arch = "x86_64")]
pub mod attn_f16;
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub mod blockq;
pub mod dense;
pub mod isa;
pub mod logits;
pub(crate) mod panels;
pub mod simd;
pub(crate) mod team;

/// A weight held by one of tinyloop's own kernels: `(rows, width)`.
pub trait Kernel: Send + Sync {
    fn rows(&self) -> usize;
    fn width(&self) -> usize;
    /// `out (m, rows) = x (m, width) · Wᵀ`.
    fn matmul(&self, x: &[f32], m: usize, out: &mut [f32]);
    /// Weight row `r` as f32 (an embedding lookup).
    fn row(&self, r: usize, out: &mut [f32]);
}

/// Shape of attention for one call: `n_heads` query heads share `n_kv_heads` K/V heads (GQA).
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}
