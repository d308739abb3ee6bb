//! Linear layers. Quantized weights go through candle's `QMatMul` (its AVX-512 VNNI kernels where it has them).
//! F16 (and F32) weights get a kernel of their own: candle would dequantize them to f32 at load (twice the memory, and twice
//! the bytes a decode step streams — the 50,257-row head dominates a small model's step) and multiply through a
//! general f32 GEMM tuned for large shapes. Here the weights stay f16, packed in panels of 64 rows (rust/panels.rs),
//! and every output is one f32 lane that takes one fused multiply-add per input position, in order, with the f16
//! weight widened exactly — so an output never depends on how many rows are multiplied at once (batched == solo,
//! bit for bit), and results equal the f32 reference up to rounding. (candle's f32 GEMM does not keep that promise:
//! from 5 rows on a row's result changes in its last bits, so F32 weights run here too.)

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use half::f16;
use std::sync::Arc;

use crate::error::Result;
use crate::panels::{by_rows, panels, Block, PanelKernel, MR, PANEL};

#[derive(Clone)]
pub enum Linear {
    Quantized(QMatMul),
    /// F16 here; Q4_0 and Q8_0 through the VNNI kernel (rust/vnni.rs), where the CPU has it.
    Own(Arc<dyn Kernel>),
}

/// A weight held by one of tinyloop's own kernels: `(rows, width)`.
pub trait Kernel: Send + Sync {
    fn rows(&self) -> usize;
    fn width(&self) -> usize;
    /// `out (m, rows) = x (m, width) · Wᵀ`.
    fn matmul(&self, x: &[f32], m: usize, out: &mut [f32]);
    /// Weight row `r` as f32 (an embedding lookup).
    fn row(&self, r: usize, out: &mut [f32]);
}

impl Linear {
    pub fn new(t: Arc<QTensor>) -> Result<Self> {
        Ok(match t.dtype() {
            GgmlDType::F16 => Self::Own(Arc::new(F16Matrix::new(&t)?)),
            // F32 too: candle's f32 GEMM gives a row different bits depending on how many rows it is multiplied
            // with (from 5 rows on), which would let batch-mates change a request's output.
            GgmlDType::F32 => Self::Own(Arc::new(DenseMatrix::<f32>::new(&t)?)),
            #[cfg(vnni)]
            GgmlDType::Q4_0 => Self::Own(Arc::new(crate::vnni::QMatrix::new(&t, crate::vnni::Codes::Nibbles)?)),
            // Q8_0 keeps candle's repacked VNNI kernel where it applies (faster at one row than ours); ours takes
            // the shapes it does not (the default model's 704-wide ffn_down).
            #[cfg(vnni)]
            GgmlDType::Q8_0 if !candle_repacks_q8_0(&t)? => {
                Self::Own(Arc::new(crate::vnni::QMatrix::new(&t, crate::vnni::Codes::Bytes)?))
            }
            _ => Self::Quantized(QMatMul::from_arc(t)?),
        })
    }

    /// `x · Wᵀ`: `(m, k)` to `(m, n)` f32.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::Quantized(q) => Ok(q.forward(x)?),
            Self::Own(w) => {
                let (m, _) = x.dims2()?;
                let out = self.forward_rows(&x.flatten_all()?.to_vec1::<f32>()?, m)?;
                Ok(Tensor::from_vec(out, (m, w.rows()), &Device::Cpu)?)
            }
        }
    }

    /// `x · Wᵀ` on plain rows: `m` rows of `k` values to `m` rows of `n`.
    pub fn forward_rows(&self, x: &[f32], m: usize) -> Result<Vec<f32>> {
        match self {
            Self::Quantized(q) => {
                let t = Tensor::from_slice(x, (m, x.len() / m.max(1)), &Device::Cpu)?;
                Ok(q.forward(&t)?.flatten_all()?.to_vec1::<f32>()?)
            }
            Self::Own(w) => {
                let mut out = vec![0f32; m * w.rows()];
                w.matmul(x, m, &mut out);
                Ok(out)
            }
        }
    }

    /// Rows `ids` of the weight as f32, `(ids.len(), k)` (an embedding lookup).
    pub fn rows(&self, ids: &[u32]) -> Result<Tensor> {
        match self {
            Self::Quantized(q) => {
                let ids = Tensor::from_slice(ids, ids.len(), &Device::Cpu)?;
                Ok(q.embedding(&ids)?.to_dtype(candle_core::DType::F32)?)
            }
            Self::Own(w) => {
                let k = w.width();
                let mut out = vec![0f32; ids.len() * k];
                for (dst, &id) in out.chunks_exact_mut(k).zip(ids) {
                    w.row(id as usize, dst);
                }
                Ok(Tensor::from_vec(out, (ids.len(), k), &Device::Cpu)?)
            }
        }
    }
}

/// Whether candle 0.11 runs this Q8_0 matrix through its repacked AVX-512 VNNI tiles: output count a multiple of 16
/// and input width a multiple of 256 (its `repack_x86::select`).
#[cfg(vnni)]
fn candle_repacks_q8_0(t: &QTensor) -> Result<bool> {
    let (n, k) = t.shape().dims2()?;
    Ok(n % 16 == 0 && k % 256 == 0)
}

/// A weight element tinyloop's dense kernel reads: f16 (widened in registers) or f32.
pub trait Dense: Copy + Send + Sync + 'static {
    const ZERO: Self;
    fn to_f32(self) -> f32;
    /// Sixteen elements at `p` as f32 lanes.
    ///
    /// # Safety
    /// `p` must point to 16 readable elements; the CPU must have AVX-512 F.
    #[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
}

impl Dense for f16 {
    const ZERO: Self = f16::ZERO;
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
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
    #[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
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
    /// None: widening a panel to f32 once per matmul (for 12+ rows) was tried and measured slower than widening in
    /// registers at every row block — the 64 KB widened panel went through L2 (prefill −15%, 16 streams −20%).
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
#[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
fn panel_dots<W: Dense, const R: usize>(x: &[f32], k: usize, i0: usize, w: &[W], out: &mut Block) {
    use std::arch::x86_64::*;
    assert!(x.len() >= (i0 + R) * k && w.len() >= k * PANEL && R <= MR);
    // SAFETY: avx512f is enabled at compile time (the cfg above); the assert keeps every read inside x and w.
    unsafe {
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
}

/// Portable version of the above, the same arithmetic (the compiler vectorizes the 64 lanes).
#[cfg(not(all(target_arch = "x86_64", target_feature = "avx512f")))]
fn panel_dots<W: Dense, const R: usize>(x: &[f32], k: usize, i0: usize, w: &[W], out: &mut Block) {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn weight(n: usize, k: usize) -> (Vec<f32>, QTensor) {
        let w: Vec<f32> = (0..n * k).map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0)).collect();
        let w16: Vec<f32> = w.iter().map(|&v| f16::from_f32(v).to_f32()).collect();
        let t = Tensor::from_vec(w.clone(), (n, k), &Device::Cpu).unwrap();
        (w16, QTensor::quantize(&t, GgmlDType::F16).unwrap())
    }

    #[test]
    fn f16_matmul_matches_f64_and_is_independent_of_the_row_count() {
        // m = 14: row blocks of 6, 6 and 2; m = 1 one row per pass.
        for &(n, k, m) in &[(33, 40, 3), (50, 256, 5), (1030, 704, 9), (130, 96, 14)] {
            let (w, q) = weight(n, k);
            let lin = Linear::new(Arc::new(q)).unwrap();
            let x: Vec<f32> = (0..m * k).map(|i| ((i * 104729 % 997) as f32 / 400.0 - 1.2)).collect();
            let xt = Tensor::from_vec(x.clone(), (m, k), &Device::Cpu).unwrap();
            let all = lin.forward(&xt).unwrap().to_vec2::<f32>().unwrap();
            for i in 0..m {
                let one = lin.forward(&xt.narrow(0, i, 1).unwrap()).unwrap().to_vec2::<f32>().unwrap();
                assert_eq!(one[0], all[i], "row {i} differs when multiplied alone (n {n}, k {k})");
                for j in 0..n {
                    let want: f64 = (0..k).map(|c| x[i * k + c] as f64 * w[j * k + c] as f64).sum();
                    assert!(
                        (all[i][j] as f64 - want).abs() < 1e-4 * (1.0 + want.abs()),
                        "({i}, {j}): {} vs {want}",
                        all[i][j]
                    );
                }
            }
        }
    }

    #[test]
    fn f16_rows_are_the_widened_weight_rows() {
        let (w, q) = weight(20, 48);
        let lin = Linear::new(Arc::new(q)).unwrap();
        let got = lin.rows(&[3, 0, 19]).unwrap().to_vec2::<f32>().unwrap();
        for (r, &id) in got.iter().zip(&[3usize, 0, 19]) {
            assert_eq!(r.as_slice(), &w[id * 48..(id + 1) * 48]);
        }
    }

    #[test]
    fn f32_weights_run_the_own_kernel_and_rows_do_not_depend_on_their_batch() {
        for (n, k) in [(64, 64), (96, 64), (70, 100)] {
            let w: Vec<f32> = (0..n * k).map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0)).collect();
            let t =
                QTensor::quantize(&Tensor::from_vec(w.clone(), (n, k), &Device::Cpu).unwrap(), GgmlDType::F32).unwrap();
            let lin = Linear::new(Arc::new(t)).unwrap();
            assert!(matches!(lin, Linear::Own(_)));
            for m in [2, 5, 8, 9] {
                let x: Vec<f32> = (0..m * k).map(|i| ((i * 104729 % 997) as f32 / 400.0 - 1.2)).collect();
                let all = lin.forward_rows(&x, m).unwrap();
                for i in 0..m {
                    assert_eq!(
                        lin.forward_rows(&x[i * k..(i + 1) * k], 1).unwrap(),
                        all[i * n..(i + 1) * n],
                        "({n}, {k}) m = {m}"
                    );
                    for j in 0..n {
                        let exact: f64 = (0..k).map(|c| x[i * k + c] as f64 * w[j * k + c] as f64).sum();
                        assert!((all[i * n + j] as f64 - exact).abs() < 1e-4 * (1.0 + exact.abs()));
                    }
                }
            }
        }
    }
}
