//! The dense matmul kernel for F16 and F32 weights. candle would dequantize F16 weights to f32 at load (twice the
//! memory, and twice the bytes a decode step streams — the 50,257-row head dominates a small model's step) and
//! multiply through a general f32 GEMM tuned for large shapes. Here the weights stay in their stored type, packed in
//! panels of 64 rows (`kernels::panels`), and every output is one f32 lane that takes one fused multiply-add per input
//! position, in order, with the f16 weight widened exactly — so an output never depends on how many rows are
//! multiplied at once (batched == solo, bit for bit), and results equal the f32 reference up to rounding. (candle's
//! f32 GEMM does not keep that promise: from 5 rows on a row's result changes in its last bits, so F32 weights run
//! here too.)

use candle_core::quantized::QTensor;
use candle_core::Device;
use half::f16;

use super::isa::{self, Isa};
use super::panels::{by_rows, panels, Block, PanelKernel, MR, PANEL};
use super::Kernel;
use crate::error::Result;

/// A weight element tinyloop's dense kernel reads: f16 (widened in registers) or f32.
pub trait Dense: Copy + Send + Sync + 'static {
    const ZERO: Self;
    fn to_f32(self) -> f32;
    /// Sixteen elements at `p` as f32 lanes.
    ///
    /// # Safety
    /// `p` must point to 16 readable elements; the CPU must have AVX-512 F.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
    /// Eight elements at `p` as f32 lanes.
    ///
    /// # Safety
    /// `p` must point to 8 readable elements; the CPU must have AVX2 and F16C.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
    /// Eight elements at `p` as two vectors of f32 lanes.
    ///
    /// # Safety
    /// `p` must point to 8 readable elements; the CPU must have NEON.
    #[cfg(target_arch = "aarch64")]
    unsafe fn load8(p: *const Self) -> [std::arch::aarch64::float32x4_t; 2];
}

impl Dense for f16 {
    const ZERO: Self = f16::ZERO;
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }
    #[cfg(target_arch = "aarch64")]
    #[target_feature(enable = "neon")]
    #[inline]
    unsafe fn load8(p: *const Self) -> [std::arch::aarch64::float32x4_t; 2] {
        use std::arch::aarch64::*;
        let h = vld1q_u16(p as *const u16);
        let (lo, hi): (float32x4_t, float32x4_t);
        // FCVTL / FCVTL2 (every ARMv8-A core; the intrinsics over `float16x8_t` are not stable Rust yet): exact.
        std::arch::asm!(
            "fcvtl {lo:v}.4s, {h:v}.4h",
            "fcvtl2 {hi:v}.4s, {h:v}.8h",
            h = in(vreg) h,
            lo = out(vreg) lo,
            hi = out(vreg) hi,
            options(pure, nomem, nostack, preserves_flags),
        );
        [lo, hi]
    }
}

impl Dense for f32 {
    const ZERO: Self = 0.0;
    fn to_f32(self) -> f32 {
        self
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512 {
        std::arch::x86_64::_mm512_loadu_ps(p)
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        std::arch::x86_64::_mm256_loadu_ps(p)
    }
    #[cfg(target_arch = "aarch64")]
    #[target_feature(enable = "neon")]
    #[inline]
    unsafe fn load8(p: *const Self) -> [std::arch::aarch64::float32x4_t; 2] {
        use std::arch::aarch64::*;
        [vld1q_f32(p), vld1q_f32(p.add(4))]
    }
}

/// An `(n, k)` dense weight kept in its stored type (F16 or F32), packed in panels of 64 rows: row `r`'s element
/// `c` is at `((r / 64) · k + c) · 64 + r % 64` (rows past `n` are zero).
pub struct DenseMatrix<W: Dense> {
    w: Vec<W>,
    n: usize,
    k: usize,
}

pub type F16Matrix = DenseMatrix<f16>;

impl DenseMatrix<f16> {
    pub fn new(t: &QTensor) -> Result<Self> {
        let (n, k) = t.shape().dims2()?;
        let rows = t.dequantize_f16(&Device::Cpu)?.flatten_all()?.to_vec1::<f16>()?;
        Ok(Self::pack(&rows, n, k))
    }
}

impl DenseMatrix<f32> {
    pub fn new(t: &QTensor) -> Result<Self> {
        let (n, k) = t.shape().dims2()?;
        let rows = t.dequantize(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?;
        Ok(Self::pack(&rows, n, k))
    }
}

impl<W: Dense> DenseMatrix<W> {
    fn pack(rows: &[W], n: usize, k: usize) -> Self {
        let mut w = vec![W::ZERO; n.div_ceil(PANEL) * k * PANEL];
        for (r, row) in rows.chunks_exact(k).enumerate() {
            let (p, o) = (r / PANEL, r % PANEL);
            for (c, &v) in row.iter().enumerate() {
                w[(p * k + c) * PANEL + o] = v;
            }
        }
        Self { w, n, k }
    }

    fn panel(&self, p: usize) -> &[W] {
        &self.w[p * self.k * PANEL..(p + 1) * self.k * PANEL]
    }

    /// `Kernel::matmul` with the bodies of `level`, one this CPU runs.
    fn matmul_at(&self, level: Isa, x: &[f32], m: usize, out: &mut [f32]) {
        let k = self.k;
        assert!(x.len() == m * k && out.len() == m * self.n, "matmul buffer sizes do not match ({m}, {k}, {})", self.n);
        panels(&DenseRun { mat: self, x, level }, m, self.n, m * self.n * k, out);
    }
}

/// One matmul's view for `panels`: the weight and the input rows.
struct DenseRun<'a, W: Dense> {
    mat: &'a DenseMatrix<W>,
    x: &'a [f32],
    level: Isa,
}

impl<W: Dense> PanelKernel for DenseRun<'_, W> {
    /// None: widening a panel to f32 once per matmul (for 12+ rows) measures slower than widening in
    /// registers at every row block — the 64 KB widened panel goes through L2 (prefill −15%, 16 streams −20%).
    type Scratch = ();

    fn block(&self, p: usize, _: &(), i0: usize, rows: usize, out: &mut Block) {
        by_rows!(rows, panel_dots::<W>(self.level, self.x, self.mat.k, i0, self.mat.panel(p), out))
    }
}

impl<W: Dense> Kernel for DenseMatrix<W> {
    fn rows(&self) -> usize {
        self.n
    }

    fn width(&self) -> usize {
        self.k
    }

    fn row(&self, r: usize, out: &mut [f32]) {
        let panel = self.panel(r / PANEL);
        for (c, v) in out.iter_mut().enumerate() {
            *v = panel[c * PANEL + r % PANEL].to_f32();
        }
    }

    fn matmul(&self, x: &[f32], m: usize, out: &mut [f32]) {
        self.matmul_at(isa::level(), x, m, out);
    }
}

/// `out[a][o] = Σ_c x[i0 + a][c] · w[c][o]` for `R` input rows and one panel `w (k, 64)`, each output one lane of
/// an accumulator that starts at 0 and takes one fused multiply-add per input position, in order — the same
/// arithmetic whatever `R` or the panel's neighbours.
/// `level` is one this CPU runs (`isa::level` or lower).
fn panel_dots<W: Dense, const R: usize>(level: Isa, x: &[f32], k: usize, i0: usize, w: &[W], out: &mut Block) {
    #[cfg(target_arch = "x86_64")]
    match level {
        // SAFETY: the CPU has AVX-512 F.
        Isa::Avx512 => return unsafe { panel_dots_avx512::<W, R>(x, k, i0, w, out) },
        // SAFETY: the CPU has AVX2, FMA and F16C.
        Isa::Avx2 => return unsafe { panel_dots_avx2::<W, R>(x, k, i0, w, out) },
        Isa::Scalar | Isa::Neon => {}
    }
    #[cfg(target_arch = "aarch64")]
    if level == Isa::Neon {
        // SAFETY: the CPU has NEON.
        return unsafe { panel_dots_neon::<W, R>(x, k, i0, w, out) };
    }
    for (a, dst) in out.iter_mut().take(R).enumerate() {
        let xr = &x[(i0 + a) * k..(i0 + a + 1) * k];
        let mut acc = [0f32; PANEL];
        for (c, &xc) in xr.iter().enumerate() {
            for (v, wv) in acc.iter_mut().zip(&w[c * PANEL..(c + 1) * PANEL]) {
                *v = xc.mul_add(wv.to_f32(), *v);
            }
        }
        *dst = acc;
    }
}

/// `panel_dots` in 4 AVX-512 vectors of 16 lanes, the same arithmetic.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn panel_dots_avx512<W: Dense, const R: usize>(x: &[f32], k: usize, i0: usize, w: &[W], out: &mut Block) {
    use std::arch::x86_64::*;
    assert!(x.len() >= (i0 + R) * k && w.len() >= k * PANEL && R <= MR);
    // The assert keeps every read inside x and w.
    let (xp, wp) = (x.as_ptr().add(i0 * k), w.as_ptr());
    let mut acc = [[_mm512_setzero_ps(); 4]; R];
    for c in 0..k {
        let wc = wp.add(c * PANEL);
        let wv = [W::load16(wc), W::load16(wc.add(16)), W::load16(wc.add(32)), W::load16(wc.add(48))];
        for (a, acc_a) in acc.iter_mut().enumerate() {
            let xa = _mm512_set1_ps(*xp.add(a * k + c));
            for (v, wt) in acc_a.iter_mut().zip(&wv) {
                *v = _mm512_fmadd_ps(xa, *wt, *v);
            }
        }
    }
    for (dst, acc_a) in out.iter_mut().zip(&acc) {
        for (t, v) in acc_a.iter().enumerate() {
            _mm512_storeu_ps(dst.as_mut_ptr().add(16 * t), *v);
        }
    }
}

/// The order the AVX2 and NEON bodies run a block's `rows` rows in. One row's accumulators for a whole panel take
/// half the registers, so the first row runs alone over the whole panel (`one(a, out[a..])`: it streams the panel
/// from memory in order — a pass over half of each line's neighbours would waste the rest); the others, with the
/// panel in cache, run in pairs over each half panel (`pair(a, out[a..], first output)`) — three rows, or two over
/// a whole panel, spill.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[inline(always)]
fn row_schedule(
    rows: usize,
    out: &mut Block,
    one: impl Fn(usize, &mut [[f32; PANEL]]),
    pair: impl Fn(usize, &mut [[f32; PANEL]], usize),
) {
    one(0, out);
    let mut a = 1;
    while a < rows {
        if rows - a == 1 {
            one(a, &mut out[a..]);
        } else {
            pair(a, &mut out[a..], 0);
            pair(a, &mut out[a..], PANEL / 2);
        }
        a += 2.min(rows - a);
    }
}

/// `panel_dots` in AVX2 vectors of 8 lanes, the same arithmetic, in `row_schedule`'s order.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn panel_dots_avx2<W: Dense, const R: usize>(x: &[f32], k: usize, i0: usize, w: &[W], out: &mut Block) {
    assert!(x.len() >= (i0 + R) * k && w.len() >= k * PANEL && R <= MR);
    row_schedule(
        R,
        out,
        |a, rows| rows8::<std::arch::x86_64::__m256, W, 1, 8>(x, k, i0 + a, w, rows, 0),
        |a, rows, o0| rows8::<std::arch::x86_64::__m256, W, 2, 4>(x, k, i0 + a, w, rows, o0),
    );
}

/// `panel_dots` in NEON vectors of 4 lanes (two per group of 8 outputs), the same arithmetic, in `row_schedule`'s
/// order.
#[cfg(target_arch = "aarch64")]
#[target_feature(enable = "neon")]
unsafe fn panel_dots_neon<W: Dense, const R: usize>(x: &[f32], k: usize, i0: usize, w: &[W], out: &mut Block) {
    assert!(x.len() >= (i0 + R) * k && w.len() >= k * PANEL && R <= MR);
    row_schedule(
        R,
        out,
        |a, rows| rows8::<[std::arch::aarch64::float32x4_t; 2], W, 1, 8>(x, k, i0 + a, w, rows, 0),
        |a, rows, o0| rows8::<[std::arch::aarch64::float32x4_t; 2], W, 2, 4>(x, k, i0 + a, w, rows, o0),
    );
}

/// Eight f32 lanes of the bodies below AVX-512: one AVX2 vector, or two NEON vectors. Each method carries its
/// instruction set's `#[target_feature]`, so it inlines into the body that calls it (`panel_dots_avx2`,
/// `panel_dots_neon`, whose closures inherit their target features).
trait Lanes8: Copy {
    unsafe fn zero() -> Self;
    unsafe fn splat(v: f32) -> Self;
    unsafe fn load<W: Dense>(p: *const W) -> Self;
    /// `self + x · w`, fused.
    unsafe fn fma(self, x: Self, w: Self) -> Self;
    unsafe fn store(self, p: *mut f32);
}

#[cfg(target_arch = "x86_64")]
impl Lanes8 for std::arch::x86_64::__m256 {
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn zero() -> Self {
        std::arch::x86_64::_mm256_setzero_ps()
    }
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn splat(v: f32) -> Self {
        std::arch::x86_64::_mm256_set1_ps(v)
    }
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn load<W: Dense>(p: *const W) -> Self {
        W::load8(p)
    }
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn fma(self, x: Self, w: Self) -> Self {
        std::arch::x86_64::_mm256_fmadd_ps(x, w, self)
    }
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn store(self, p: *mut f32) {
        std::arch::x86_64::_mm256_storeu_ps(p, self)
    }
}

#[cfg(target_arch = "aarch64")]
impl Lanes8 for [std::arch::aarch64::float32x4_t; 2] {
    #[target_feature(enable = "neon")]
    #[inline]
    unsafe fn zero() -> Self {
        [std::arch::aarch64::vdupq_n_f32(0.0); 2]
    }
    #[target_feature(enable = "neon")]
    #[inline]
    unsafe fn splat(v: f32) -> Self {
        [std::arch::aarch64::vdupq_n_f32(v); 2]
    }
    #[target_feature(enable = "neon")]
    #[inline]
    unsafe fn load<W: Dense>(p: *const W) -> Self {
        W::load8(p)
    }
    #[target_feature(enable = "neon")]
    #[inline]
    unsafe fn fma(self, x: Self, w: Self) -> Self {
        use std::arch::aarch64::vfmaq_f32;
        [vfmaq_f32(self[0], x[0], w[0]), vfmaq_f32(self[1], x[1], w[1])]
    }
    #[target_feature(enable = "neon")]
    #[inline]
    unsafe fn store(self, p: *mut f32) {
        std::arch::aarch64::vst1q_f32(p, self[0]);
        std::arch::aarch64::vst1q_f32(p.add(4), self[1]);
    }
}

/// Outputs `o0..o0 + 8V` of `N` rows, in groups of 8 lanes (`row_schedule`'s passes; the caller checked the
/// bounds): each output one lane that takes one fused multiply-add per input position, in order.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[inline(always)]
unsafe fn rows8<L: Lanes8, W: Dense, const N: usize, const V: usize>(
    x: &[f32],
    k: usize,
    i0: usize,
    w: &[W],
    out: &mut [[f32; PANEL]],
    o0: usize,
) {
    let (xp, wp) = (x.as_ptr().add(i0 * k), w.as_ptr().add(o0));
    let mut acc = [[L::zero(); V]; N];
    for c in 0..k {
        let wc = wp.add(c * PANEL);
        let xs: [L; N] = std::array::from_fn(|a| L::splat(*xp.add(a * k + c)));
        for t in 0..V {
            let wt = L::load(wc.add(8 * t));
            for (acc_a, xa) in acc.iter_mut().zip(&xs) {
                acc_a[t] = acc_a[t].fma(*xa, wt);
            }
        }
    }
    for (dst, acc_a) in out.iter_mut().zip(&acc) {
        for (t, v) in acc_a.iter().enumerate() {
            v.store(dst.as_mut_ptr().add(o0 + 8 * t));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_level_gives_the_same_bits() {
        // m = 1..=8 covers every row count a kernel call takes and the AVX2 body's groups of three.
        for &(n, k, m) in &[(70, 48, 8), (64, 704, 5), (130, 33, 7)] {
            let w: Vec<f16> = (0..n * k).map(|i| f16::from_f32((i * 7919 % 1000) as f32 / 500.0 - 1.0)).collect();
            let mats = (
                DenseMatrix::pack(&w, n, k),
                DenseMatrix::pack(&w.iter().map(|v| v.to_f32()).collect::<Vec<_>>(), n, k),
            );
            let x: Vec<f32> = (0..m * k).map(|i| (i * 104729 % 997) as f32 / 400.0 - 1.2).collect();
            let run = |level: Isa, wide: bool| {
                let mut out = vec![0f32; m * n];
                if wide {
                    mats.1.matmul_at(level, &x, m, &mut out)
                } else {
                    mats.0.matmul_at(level, &x, m, &mut out)
                }
                out
            };
            let want = run(Isa::Scalar, false);
            for level in isa::runnable() {
                assert_eq!(run(level, false), want, "f16 at {level:?} ({n}, {k}, {m})");
                assert_eq!(run(level, true), want, "f32 at {level:?} ({n}, {k}, {m})");
            }
        }
    }
}
