//! Q4_0 and Q8_0 weights × Q8_0-quantized inputs with AVX-512 VNNI, for any number of input rows (decode,
//! verification, batched decode, prefill). candle runs Q4_0 (and Q8_0 rows whose width is not a multiple of 256)
//! through a generic per-block dot product; llama.cpp repacks and runs tiled kernels, several times faster at
//! prefill. This is tinyloop's own:
//!
//! - inputs are quantized per 32-value block exactly as ggml's x86 code does (`d = amax / 127` stored as f16,
//!   `x / d` rounded to nearest, ties to even),
//!   so the arithmetic is the one llama.cpp runs on the same weights;
//! - weights are repacked at load into unsigned codes (Q4_0: nibbles, 16 bytes per block; Q8_0: the byte + 128,
//!   interleaved like the expanded nibbles) and f32 block scales, two blocks per step;
//! - one `vpdpbusd` multiplies 64 unsigned codes by 64 signed input bytes; the code offset (8 or 128) is folded into
//!   the accumulator's start (−offset · Σx per lane group, precomputed per input row), so the lanes hold exact integer
//!   sums; each output then keeps one 16-lane f32 accumulator that walks the blocks in order, and is reduced at the
//!   end. An output never depends on how many rows are multiplied together, or which: batched == solo, bit for bit.
//! - a 4 × 4 block of (input row, weight row) outputs shares every load; `linear::tiled` spreads tiles of 16
//!   weight rows over the rayon pool.

use std::arch::x86_64::*;

use candle_core::quantized::QTensor;
use half::f16;

use crate::error::{Error, Result};
use crate::linear::{tiled, Kernel};

const QK: usize = 32;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codes {
    /// Q4_0: value j of a block in the low nibble of byte j, value j + 16 in its high nibble; offset 8.
    Nibbles,
    /// Q8_0: one byte per value, + 128; a pair of blocks stored as `w_b[0..16], w_b+1[0..16], w_b[16..32],
    /// w_b+1[16..32]`, the order the nibbles expand to.
    Bytes,
}

impl Codes {
    fn block_bytes(self) -> usize {
        match self {
            Self::Nibbles => 16,
            Self::Bytes => 32,
        }
    }

    fn offset(self) -> i32 {
        match self {
            Self::Nibbles => 8,
            Self::Bytes => 128,
        }
    }
}

/// An `(n, k)` Q4_0 or Q8_0 weight, repacked: row r's block b has its codes at
/// `qs[(r·nb + b)·block_bytes..]` and its scale at `d[r·nb + b]`. `nb` is rounded up to even; a padding block has
/// scale 0.
pub struct QMatrix {
    codes: Codes,
    qs: Vec<u8>,
    d: Vec<f32>,
    n: usize,
    k: usize,
    nb: usize,
}

/// Input rows quantized to Q8_0 and laid out to match: for each pair of blocks (b, b + 1), 64 bytes
/// `x_b[0..16], x_{b+1}[0..16], x_b[16..32], x_{b+1}[16..32]`; its 16-lane scale vector (d_b in lanes 0–3 and 8–11,
/// d_{b+1} in 4–7 and 12–15); and the lanes' starting value −offset · Σ of the 4 bytes each lane multiplies.
struct Q8Rows {
    qs: Vec<i8>,
    scale: Vec<f32>,
    start: Vec<i32>,
    pairs: usize,
}

impl QMatrix {
    pub fn new(t: &QTensor, codes: Codes) -> Result<Self> {
        let (n, k) = t.shape().dims2()?;
        if k % QK != 0 {
            return Err(Error::Internal(format!("block-quantized weight width {k} is not a multiple of {QK}")));
        }
        let raw = t.data()?;
        let (blocks, bb) = (k / QK, codes.block_bytes());
        let stride = 2 + bb; // ggml block: f16 scale, then the codes
        if raw.len() != n * blocks * stride {
            return Err(Error::Internal(format!("quantized weight of {} bytes for shape ({n}, {k})", raw.len())));
        }
        let nb = blocks.div_ceil(2) * 2;
        let mut qs = vec![0u8; n * nb * bb];
        if codes == Codes::Bytes {
            qs.fill(128); // padding blocks: code 128 is value 0
        }
        let mut d = vec![0f32; n * nb];
        for r in 0..n {
            for b in 0..blocks {
                let src = &raw[(r * blocks + b) * stride..(r * blocks + b + 1) * stride];
                d[r * nb + b] = f16::from_le_bytes([src[0], src[1]]).to_f32();
                match codes {
                    Codes::Nibbles => qs[(r * nb + b) * bb..(r * nb + b + 1) * bb].copy_from_slice(&src[2..]),
                    Codes::Bytes => {
                        // Within the pair (b & !1, b | 1): this block's halves go to 16·(b % 2) and 32 + 16·(b % 2).
                        let pair = &mut qs[(r * nb + (b & !1)) * bb..(r * nb + (b & !1) + 2) * bb];
                        let h = 16 * (b % 2);
                        for j in 0..16 {
                            pair[h + j] = (src[2 + j] as i8 as i32 + 128) as u8;
                            pair[32 + h + j] = (src[2 + 16 + j] as i8 as i32 + 128) as u8;
                        }
                    }
                }
            }
        }
        Ok(Self { codes, qs, d, n, k, nb })
    }

    /// Outputs (x rows `i0..i0+MI`) × (weight rows `w0..w0+NJ`).
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn dots<const MI: usize, const NJ: usize>(&self, xq: &Q8Rows, i0: usize, w0: usize, acc: &mut [[f32; 4]; 4]) {
        let nb = self.nb;
        let low = _mm256_set1_epi8(0x0F);
        // Lane l takes block (l / 4) % 2 of the pair: index 0 for lanes 0–3 and 8–11, 1 for 4–7 and 12–15.
        let pick = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
        let mut v = [[_mm512_setzero_ps(); NJ]; MI];
        for p in 0..nb / 2 {
            let mut wq = [_mm512_setzero_si512(); NJ];
            let mut wd = [_mm512_setzero_ps(); NJ];
            for b in 0..NJ {
                let r = w0 + b;
                wq[b] = match self.codes {
                    Codes::Nibbles => {
                        let raw = _mm256_loadu_si256(self.qs.as_ptr().add((r * nb + 2 * p) * 16) as *const __m256i);
                        let lo = _mm256_and_si256(raw, low);
                        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), low);
                        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
                    }
                    Codes::Bytes => _mm512_loadu_si512(self.qs.as_ptr().add((r * nb + 2 * p) * 32) as *const __m512i),
                };
                let two = _mm_castpd_ps(_mm_load_sd(self.d.as_ptr().add(r * nb + 2 * p) as *const f64));
                wd[b] = _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(two));
            }
            for (a, va) in v.iter_mut().enumerate() {
                let row = (i0 + a) * xq.pairs + p;
                let xv = _mm512_loadu_si512(xq.qs.as_ptr().add(row * 64) as *const __m512i);
                let xs = _mm512_loadu_ps(xq.scale.as_ptr().add(row * 16));
                let start = _mm512_loadu_si512(xq.start.as_ptr().add(row * 16) as *const __m512i);
                for (vab, (q, d)) in va.iter_mut().zip(wq.iter().zip(&wd)) {
                    let dot = _mm512_dpbusd_epi32(start, *q, xv);
                    *vab = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(*d, xs), *vab);
                }
            }
        }
        for a in 0..MI {
            for b in 0..NJ {
                acc[a][b] = _mm512_reduce_add_ps(v[a][b]);
            }
        }
    }
}

impl Kernel for QMatrix {
    fn rows(&self) -> usize {
        self.n
    }

    fn width(&self) -> usize {
        self.k
    }

    /// Weight row `r` dequantized (an embedding lookup).
    fn row(&self, r: usize, out: &mut [f32]) {
        let bb = self.codes.block_bytes();
        for (b, chunk) in out.chunks_exact_mut(QK).enumerate() {
            let d = self.d[r * self.nb + b];
            let (lo, hi): ([i32; 16], [i32; 16]) = match self.codes {
                Codes::Nibbles => {
                    let q = &self.qs[(r * self.nb + b) * bb..][..16];
                    (std::array::from_fn(|j| (q[j] & 0x0F) as i32 - 8), std::array::from_fn(|j| (q[j] >> 4) as i32 - 8))
                }
                Codes::Bytes => {
                    let pair = &self.qs[(r * self.nb + (b & !1)) * bb..][..2 * bb];
                    let h = 16 * (b % 2);
                    (std::array::from_fn(|j| pair[h + j] as i32 - 128), std::array::from_fn(|j| pair[32 + h + j] as i32 - 128))
                }
            };
            for j in 0..16 {
                chunk[j] = lo[j] as f32 * d;
                chunk[j + 16] = hi[j] as f32 * d;
            }
        }
    }

    /// `out (m, n) = x (m, k) · Wᵀ`.
    fn matmul(&self, x: &[f32], m: usize, out: &mut [f32]) {
        let k = self.k;
        assert!(x.len() == m * k && out.len() == m * self.n, "matmul buffer sizes do not match ({m}, {k}, {})", self.n);
        let xq = Q8Rows::quantize(x, m, k, self.nb, self.codes.offset());
        // SAFETY: the cfg of this module guarantees AVX-512 F/BW/VNNI; `tiled` keeps blocks within the rows.
        tiled(m, self.n, m * self.n * k, out, &|i, mi, j, nj, acc| unsafe {
            match (mi, nj) {
                (4, 4) => self.dots::<4, 4>(&xq, i, j, acc),
                (4, _) => self.dots::<4, 1>(&xq, i, j, acc),
                (_, 4) => self.dots::<1, 4>(&xq, i, j, acc),
                _ => self.dots::<1, 1>(&xq, i, j, acc),
            }
        });
    }
}

/// One block of 32 activations as ggml's AVX code quantizes it: `d = amax / 127`, `q = round(x / d)` to nearest
/// (ties to even, the vector unit's mode), saturated to i8. Returns `d` (before its f16 rounding).
fn quantize_block(xb: &[f32], q: &mut [i8; QK]) -> f32 {
    assert_eq!(xb.len(), QK);
    // SAFETY: the cfg of this module guarantees AVX-512 F; xb holds 32 floats and q 32 bytes (checked above).
    unsafe {
        let (a, b) = (_mm512_loadu_ps(xb.as_ptr()), _mm512_loadu_ps(xb.as_ptr().add(16)));
        let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        let d = amax / 127.0;
        let id = _mm512_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
        let round = |v| _mm512_cvtsepi32_epi8(_mm512_cvt_roundps_epi32::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(v, id)));
        _mm_storeu_si128(q.as_mut_ptr() as *mut __m128i, round(a));
        _mm_storeu_si128(q.as_mut_ptr().add(16) as *mut __m128i, round(b));
        d
    }
}

impl Q8Rows {
    fn quantize(x: &[f32], m: usize, k: usize, nb: usize, offset: i32) -> Self {
        let pairs = nb / 2;
        let mut qs = vec![0i8; m * pairs * 64];
        let mut scale = vec![0f32; m * pairs * 16];
        let mut start = vec![0i32; m * pairs * 16];
        let mut q = [0i8; QK];
        for i in 0..m {
            for b in 0..k / QK {
                let d = quantize_block(&x[i * k + b * QK..i * k + (b + 1) * QK], &mut q);
                let (row, half) = (i * pairs + b / 2, b % 2);
                // Halves of block b go to bytes 16·half..+16 (values 0..16) and 32 + 16·half..+16 (16..32).
                qs[row * 64 + 16 * half..][..16].copy_from_slice(&q[..16]);
                qs[row * 64 + 32 + 16 * half..][..16].copy_from_slice(&q[16..]);
                let dq = f16::from_f32(d).to_f32();
                for lane in [0, 1, 2, 3, 8, 9, 10, 11].map(|l| l + 4 * half) {
                    scale[row * 16 + lane] = dq;
                    let bytes = &qs[row * 64 + 4 * lane..][..4];
                    start[row * 16 + lane] = -offset * bytes.iter().map(|&v| v as i32).sum::<i32>();
                }
            }
        }
        Self { qs, scale, start, pairs }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::GgmlDType;
    use candle_core::{Device, Tensor};

    #[test]
    fn matmul_matches_ggml_arithmetic_and_is_independent_of_the_row_count() {
        let shapes = [(20, 64, 1), (33, 96, 6), (70, 704, 9)];
        for (&(n, k, m), (dtype, codes)) in shapes.iter().flat_map(|s| [(s, (GgmlDType::Q4_0, Codes::Nibbles)), (s, (GgmlDType::Q8_0, Codes::Bytes))]) {
            let w: Vec<f32> = (0..n * k).map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0)).collect();
            let q = QTensor::quantize(&Tensor::from_vec(w, (n, k), &Device::Cpu).unwrap(), dtype).unwrap();
            let mat = QMatrix::new(&q, codes).unwrap();
            let x: Vec<f32> = (0..m * k).map(|i| ((i * 104729 % 997) as f32 / 400.0 - 1.2)).collect();
            let mut all = vec![0f32; m * n];
            mat.matmul(&x, m, &mut all);
            // Reference: ggml's Q8_0 input quantization and per-block integer dot products, in f64.
            let deq = q.dequantize(&Device::Cpu).unwrap().to_vec2::<f32>().unwrap();
            for i in 0..m {
                let mut one = vec![0f32; n];
                mat.matmul(&x[i * k..(i + 1) * k], 1, &mut one);
                assert_eq!(one, all[i * n..(i + 1) * n], "row {i} differs when multiplied alone ({n}, {k})");
                for j in 0..n {
                    let mut want = 0f64;
                    for b in 0..k / QK {
                        let xb = &x[i * k + b * QK..i * k + (b + 1) * QK];
                        let d = xb.iter().fold(0f32, |s, v| s.max(v.abs())) / 127.0;
                        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                        let dq = f16::from_f32(d).to_f32() as f64;
                        for (c, &v) in xb.iter().enumerate() {
                            want += deq[j][b * QK + c] as f64 * (v * id).round_ties_even() as f64 * dq;
                        }
                    }
                    let got = all[i * n + j] as f64;
                    assert!((got - want).abs() < 1e-4 * (1.0 + want.abs()), "({i}, {j}) of ({n}, {k}): {got} vs {want}");
                }
            }
            for row in [0, n - 1] {
                let mut r = vec![0f32; k];
                mat.row(row, &mut r);
                assert_eq!(r, deq[row], "{dtype:?} row {row}");
            }
        }
    }
}
