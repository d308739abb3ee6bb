//! Linear layers. Quantized weights go through candle's `QMatMul` (its AVX-512 VNNI kernels where it has them).
//! F16 (and F32) weights get a kernel of their own: candle would dequantize them to f32 at load (twice the memory, and twice
//! the bytes a decode step streams — the 50,257-row head dominates a small model's step) and multiply through a
//! general f32 GEMM tuned for large shapes. Here the weights stay f16 and every output is one dot product of an f32
//! input row with an f16 weight row widened to f32 (exact), accumulated in 16 f32 lanes in a fixed order — so an
//! output never depends on how many rows are multiplied at once (batched == solo, bit for bit), and results equal
//! the f32 reference up to summation order. (candle's f32 GEMM does not keep that promise: from 5 rows on a row's
//! result changes in its last bits, so F32 weights run here too.) Rows of the weight are split across the rayon pool in tiles, each used
//! for every input row while it is in cache.

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;
use std::sync::Arc;

use crate::error::Result;

/// Weight rows widened together (a tile of `TILE · k` f32 stays in L1/L2 while every input row uses it).
const TILE: usize = 16;
/// Below this many multiply-adds a matmul runs on the calling thread (a pool round trip costs more).
const PARALLEL_MIN: usize = 1 << 18;
const LANES: usize = 16;

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
    fn to_f32(self) -> f32;
    /// `dst = src` as f32 (equal lengths).
    fn widen(src: &[Self], dst: &mut [f32]);
    /// Sixteen elements at `p` as f32 lanes.
    ///
    /// # Safety
    /// `p` must point to 16 readable elements; the CPU must have AVX-512 F.
    #[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
}

impl Dense for f16 {
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn widen(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    #[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }
}

impl Dense for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    fn widen(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    #[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512 {
        std::arch::x86_64::_mm512_loadu_ps(p)
    }
}

/// An `(n, k)` dense weight, row-major, kept in its stored type (F16 or F32).
pub struct DenseMatrix<W: Dense> {
    w: Vec<W>,
    n: usize,
    k: usize,
}

pub type F16Matrix = DenseMatrix<f16>;

impl DenseMatrix<f16> {
    pub fn new(t: &QTensor) -> Result<Self> {
        let (n, k) = t.shape().dims2()?;
        let w = t.dequantize_f16(&Device::Cpu)?.flatten_all()?.to_vec1::<f16>()?;
        Ok(Self { w, n, k })
    }
}

impl DenseMatrix<f32> {
    pub fn new(t: &QTensor) -> Result<Self> {
        let (n, k) = t.shape().dims2()?;
        let w = t.dequantize(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?;
        Ok(Self { w, n, k })
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
        W::widen(&self.w[r * self.k..(r + 1) * self.k], out);
    }

    fn matmul(&self, x: &[f32], m: usize, out: &mut [f32]) {
        let k = self.k;
        assert!(x.len() == m * k && out.len() == m * self.n, "matmul buffer sizes do not match ({m}, {k}, {})", self.n);
        tiled(m, self.n, m * self.n * k, out, &|i, mi, j, nj, acc| {
            let (xs, ws) = (&x[i * k..(i + mi) * k], &self.w[j * k..(j + nj) * k]);
            match (mi, nj) {
                (4, 4) => dots::<W, 4, 4>(xs, ws, k, acc),
                (4, _) => dots::<W, 4, 1>(xs, ws, k, acc),
                (_, 4) => dots::<W, 1, 4>(xs, ws, k, acc),
                _ => dots::<W, 1, 1>(xs, ws, k, acc),
            }
        });
    }
}

/// A block of outputs: `acc[a][b]` = input row `i + a` · weight row `j + b`, for `a < mi`, `b < nj` (each 4 or 1).
pub(crate) type Block<'a> = dyn Fn(usize, usize, usize, usize, &mut [[f32; 4]; 4]) + Sync + 'a;

/// The output buffer, shared by the tiles of one `tiled` call: each tile writes only its own columns.
struct Columns(*mut f32);
// SAFETY: tiles write disjoint columns of the buffer (see `tiled`), which outlives the parallel region.
unsafe impl Sync for Columns {}

impl Columns {
    /// Copy `vals` to `out[row * n + col ..]`.
    ///
    /// # Safety
    /// The range must lie inside the buffer and belong to the calling tile alone.
    unsafe fn write(&self, at: usize, vals: &[f32]) {
        std::ptr::copy_nonoverlapping(vals.as_ptr(), self.0.add(at), vals.len());
    }
}

/// `out (m, n)`: weight rows in tiles of `TILE` (spread over the rayon pool when the product has at least
/// `PARALLEL_MIN` multiply-adds), each tile in blocks of 4 × 4 outputs (1-wide at the edges) computed by `block`
/// and written straight into its own columns of `out`.
pub(crate) fn tiled(m: usize, n: usize, macs: usize, out: &mut [f32], block: &Block) {
    assert_eq!(out.len(), m * n, "tiled output buffer size");
    let cols = Columns(out.as_mut_ptr());
    let run = |t: usize| {
        let rows = t * TILE..((t + 1) * TILE).min(n);
        let width = rows.len();
        let mut i = 0;
        while i < m {
            let mi = if m - i >= 4 { 4 } else { 1 };
            let mut j = 0;
            while j < width {
                let nj = if width - j >= 4 { 4 } else { 1 };
                let mut acc = [[0f32; 4]; 4];
                block(i, mi, rows.start + j, nj, &mut acc);
                for (a, row) in acc.iter().take(mi).enumerate() {
                    // SAFETY: i + a < m and rows.start + j + nj <= rows.end <= n, so the range is inside the
                    // m · n buffer; only tile t writes columns `rows`.
                    unsafe { cols.write((i + a) * n + rows.start + j, &row[..nj]) };
                }
                j += nj;
            }
            i += mi;
        }
    };
    let tiles = n.div_ceil(TILE);
    if macs >= PARALLEL_MIN {
        (0..tiles).into_par_iter().for_each(run);
    } else {
        (0..tiles).for_each(run);
    }
}

/// `acc[a][b] = Σ_c x[a][c] · w[b][c]` for an `MI × NJ` block (rows of length `k`), w widened to f32. Every
/// output is computed the same way whatever the block shape — one 16-lane accumulator walking k in order, its
/// lanes summed, then the tail — so an output never depends on its neighbours. The block shares loads: each x
/// chunk feeds NJ products, each widened w chunk MI.
#[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
fn dots<W: Dense, const MI: usize, const NJ: usize>(x: &[f32], w: &[W], k: usize, acc: &mut [[f32; 4]; 4]) {
    use std::arch::x86_64::*;
    assert!(x.len() >= MI * k && w.len() >= NJ * k && MI <= 4 && NJ <= 4);
    // SAFETY: avx512f is enabled at compile time (the cfg above); every load reads 16 elements below row end.
    unsafe {
        let mut v = [[_mm512_setzero_ps(); NJ]; MI];
        let mut c = 0;
        while c + LANES <= k {
            let mut wv = [_mm512_setzero_ps(); NJ];
            for (b, wb) in wv.iter_mut().enumerate() {
                *wb = W::load16(w.as_ptr().add(b * k + c));
            }
            for (a, va) in v.iter_mut().enumerate() {
                let xa = _mm512_loadu_ps(x.as_ptr().add(a * k + c));
                for (vab, wb) in va.iter_mut().zip(&wv) {
                    *vab = _mm512_fmadd_ps(xa, *wb, *vab);
                }
            }
            c += LANES;
        }
        for a in 0..MI {
            for b in 0..NJ {
                let tail = (c..k).fold(0f32, |s, i| x[a * k + i].mul_add(w[b * k + i].to_f32(), s));
                acc[a][b] = _mm512_reduce_add_ps(v[a][b]) + tail;
            }
        }
    }
}

/// Portable version of the above (the compiler vectorizes the lanes).
#[cfg(not(all(target_arch = "x86_64", target_feature = "avx512f")))]
fn dots<W: Dense, const MI: usize, const NJ: usize>(x: &[f32], w: &[W], k: usize, acc: &mut [[f32; 4]; 4]) {
    let mut wide = [0f32; LANES];
    for a in 0..MI {
        for b in 0..NJ {
            let (xr, wr) = (&x[a * k..(a + 1) * k], &w[b * k..(b + 1) * k]);
            let mut lanes = [0f32; LANES];
            let (xc, wc) = (xr.chunks_exact(LANES), wr.chunks_exact(LANES));
            let (xt, wt) = (xc.remainder(), wc.remainder());
            for (p, q) in xc.zip(wc) {
                W::widen(q, &mut wide);
                for l in 0..LANES {
                    lanes[l] = p[l].mul_add(wide[l], lanes[l]);
                }
            }
            let tail = xt.iter().zip(wt).fold(0f32, |s, (p, q)| p.mul_add(q.to_f32(), s));
            acc[a][b] = lanes.iter().sum::<f32>() + tail;
        }
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
        for &(n, k, m) in &[(33, 40, 3), (50, 256, 5), (1030, 704, 9)] {
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
                    assert!((all[i][j] as f64 - want).abs() < 1e-4 * (1.0 + want.abs()), "({i}, {j}): {} vs {want}", all[i][j]);
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
            let t = QTensor::quantize(&Tensor::from_vec(w.clone(), (n, k), &Device::Cpu).unwrap(), GgmlDType::F32).unwrap();
            let lin = Linear::new(Arc::new(t)).unwrap();
            assert!(matches!(lin, Linear::Own(_)));
            for m in [2, 5, 8, 9] {
                let x: Vec<f32> = (0..m * k).map(|i| ((i * 104729 % 997) as f32 / 400.0 - 1.2)).collect();
                let all = lin.forward_rows(&x, m).unwrap();
                for i in 0..m {
                    assert_eq!(lin.forward_rows(&x[i * k..(i + 1) * k], 1).unwrap(), all[i * n..(i + 1) * n], "({n}, {k}) m = {m}");
                    for j in 0..n {
                        let exact: f64 = (0..k).map(|c| x[i * k + c] as f64 * w[j * k + c] as f64).sum();
                        assert!((all[i * n + j] as f64 - exact).abs() < 1e-4 * (1.0 + exact.abs()));
                    }
                }
            }
        }
    }
}
