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

#[cfg(target_arch = "x86_64")]
use super::isa;
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
}

/// One matmul's view for `panels`: the weight and the input rows.
struct DenseRun<'a, W: Dense> {
    mat: &'a DenseMatrix<W>,
    x: &'a [f32],
}

impl<W: Dense> PanelKernel for DenseRun<'_, W> {
    /// None: widening a panel to f32 once per matmul (for 12+ rows) measures slower than widening in
    /// registers at every row block — the 64 KB widened panel goes through L2 (prefill −15%, 16 streams −20%).
    type Scratch = ();

    fn block(&self, p: usize, _: &(), i0: usize, rows: usize, out: &mut Block) {
        by_rows!(rows, panel_dots::<W>(self.x, self.mat.k, i0, self.mat.panel(p), out))
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
        let k = self.k;
        assert!(x.len() == m * k && out.len() == m * self.n, "matmul buffer sizes do not match ({m}, {k}, {})", self.n);
        panels(&DenseRun { mat: self, x }, m, self.n, m * self.n * k, out);
    }
}

/// `out[a][o] = Σ_c x[i0 + a][c] · w[c][o]` for `R` input rows and one panel `w (k, 64)`, each output one lane of
/// an accumulator that starts at 0 and takes one fused multiply-add per input position, in order — the same
/// arithmetic whatever `R` or the panel's neighbours.
fn panel_dots<W: Dense, const R: usize>(x: &[f32], k: usize, i0: usize, w: &[W], out: &mut Block) {
    #[cfg(target_arch = "x86_64")]
    if isa::avx512() {
        // SAFETY: the CPU has AVX-512 F (`isa::avx512`).
        return unsafe { panel_dots_avx512::<W, R>(x, k, i0, w, out) };
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
