//! Q4_0 and Q8_0 weights × Q8_0-quantized inputs with AVX-512 VNNI, for any number of input rows (decode,
//! verification, batched decode, prefill). candle runs Q4_0 (and Q8_0 rows whose width is not a multiple of 256)
//! through a generic per-block dot product; llama.cpp repacks and runs tiled kernels, several times faster at
//! prefill. This is tinyloop's own:
//!
//! - inputs are quantized per 32-value block exactly as ggml's x86 code does (`d = amax / 127` stored as f16,
//!   `x / d` rounded to nearest, ties to even), so the arithmetic is the one llama.cpp runs on the same weights;
//! - weights are repacked at load into panels of 64 rows (`kernels::panels`): for each block, each group of 4 input
//!   positions holds the 64 rows' 4 codes side by side — one 64-byte vector per 16 rows — with the rows' f32
//!   scales next to them;
//! - `vpdpbusd` multiplies 16 rows' 4 codes by 4 input bytes broadcast to every lane, so each lane collects one
//!   output's exact integer block sum (Q4_0: unsigned nibbles × signed inputs, less 8 · Σx; Q8_0: inputs + 128 ×
//!   signed codes, less 128 · Σw, precomputed per row and block); the block sum then takes one fused multiply-add
//!   with `d_x · d_w` into the output's f32 lane. No horizontal sums; an output never depends on how many rows are
//!   multiplied together, or which: batched == solo, bit for bit.

use std::arch::x86_64::*;

use candle_core::quantized::QTensor;
use half::f16;

use super::isa;
use super::panels::{panels, Block, PanelKernel, PANEL};
use super::Kernel;
use crate::error::{Error, Result};

const QK: usize = 32;
/// Input rows one pass over a panel's blocks serves (their integer and float accumulators fill the registers).
const ROWS: usize = 3;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codes {
    /// Q4_0: ggml's 16 bytes per block (value j in the low nibble of byte j, value j + 16 in its high nibble),
    /// taken as unsigned 0..15 (offset 8).
    Nibbles,
    /// Q8_0: one signed byte per value.
    Bytes,
}

impl Codes {
    /// Bytes of one row's block.
    fn block_bytes(self) -> usize {
        match self {
            Self::Nibbles => 16,
            Self::Bytes => 32,
        }
    }
}

/// An `(n, k)` Q4_0 or Q8_0 weight in panels of 64 rows. Block `b` of panel `p` (`pb = p · nb + b`) holds its
/// codes at `qs[pb · 64 · block_bytes..]` as groups of 256 bytes, each the 64 rows' 4 bytes of one byte
/// position group (`g · 256 + row · 4 + j` is the row's block byte `4g + j`); the rows' scales at `d[pb · 64..]`;
/// for Q8_0 the rows' `−128 · Σ codes` at `start[pb · 64..]`. Rows past `n` have scale 0.
pub struct QMatrix {
    codes: Codes,
    qs: Vec<u8>,
    d: Vec<f32>,
    start: Vec<i32>,
    n: usize,
    k: usize,
    nb: usize,
}

/// Input rows quantized to Q8_0: row `i`'s block `b` (`ib = i · nb + b`) at `qs[ib · 32..]` (+ 128 for Q8_0
/// weights, which take the inputs as the unsigned operand), its scale `d[ib]` and, for Q4_0 weights, `−8 · Σ q` at
/// `start[ib]`.
struct Q8Rows {
    qs: Vec<u8>,
    d: Vec<f32>,
    start: Vec<i32>,
}

impl QMatrix {
    /// The repacked weight; an error where the CPU lacks AVX-512 VNNI (`isa::vnni`), which every kernel here needs.
    pub fn new(t: &QTensor, codes: Codes) -> Result<Self> {
        if !isa::vnni() {
            return Err(Error::Internal("the Q4_0 / Q8_0 kernel needs AVX-512 VNNI".into()));
        }
        let (n, k) = t.shape().dims2()?;
        if k % QK != 0 {
            return Err(Error::Internal(format!("block-quantized weight width {k} is not a multiple of {QK}")));
        }
        let raw = t.data()?;
        let (nb, bb) = (k / QK, codes.block_bytes());
        let stride = 2 + bb; // ggml block: f16 scale, then the codes
        if raw.len() != n * nb * stride {
            return Err(Error::Internal(format!("quantized weight of {} bytes for shape ({n}, {k})", raw.len())));
        }
        let blocks = n.div_ceil(PANEL) * nb;
        let pad = if codes == Codes::Nibbles { 0x88 } else { 0 }; // value 0 either way
        let mut qs = vec![pad; blocks * PANEL * bb];
        let mut d = vec![0f32; blocks * PANEL];
        let mut start = vec![0i32; if codes == Codes::Bytes { blocks * PANEL } else { 0 }];
        for r in 0..n {
            let (p, o) = (r / PANEL, r % PANEL);
            for b in 0..nb {
                let src = &raw[(r * nb + b) * stride..(r * nb + b + 1) * stride];
                let pb = p * nb + b;
                d[pb * PANEL + o] = f16::from_le_bytes([src[0], src[1]]).to_f32();
                for (t, &byte) in src[2..].iter().enumerate() {
                    qs[pb * PANEL * bb + (t / 4) * 4 * PANEL + o * 4 + t % 4] = byte;
                }
                if codes == Codes::Bytes {
                    start[pb * PANEL + o] = -128 * src[2..].iter().map(|&v| v as i8 as i32).sum::<i32>();
                }
            }
        }
        Ok(Self { codes, qs, d, start, n, k, nb })
    }

    /// Block byte `t` of row `r`'s block `b`.
    fn byte(&self, r: usize, b: usize, t: usize) -> u8 {
        let (pb, o, bb) = ((r / PANEL) * self.nb + b, r % PANEL, self.codes.block_bytes());
        self.qs[pb * PANEL * bb + (t / 4) * 4 * PANEL + o * 4 + t % 4]
    }

    /// `out[a][o]` for input rows `i0..i0 + R` and panel `p`.
    /// `unpacked`: Q4_0 only, the panel's codes as one byte each (`unpack`), or empty to expand the nibbles here.
    // 87 lines: the hot kernel keeps its accumulators in registers across the three code layouts' inner loops.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn panel_dots<const R: usize>(
        &self,
        xq: &Q8Rows,
        p: usize,
        i0: usize,
        unpacked: &[u8],
        out: &mut [[f32; PANEL]],
    ) {
        let (nb, bb) = (self.nb, self.codes.block_bytes());
        assert!(xq.d.len() >= (i0 + R) * nb && self.d.len() >= (p + 1) * nb * PANEL && out.len() >= R);
        let low = _mm512_set1_epi8(0x0F);
        let mut acc = [[_mm512_setzero_ps(); 4]; R];
        for b in 0..nb {
            let pb = p * nb + b;
            let w = self.qs.as_ptr().add(pb * PANEL * bb);
            let x = |a: usize, t: usize| {
                let at = xq.qs.as_ptr().add(((i0 + a) * nb + b) * QK + t);
                _mm512_set1_epi32((at as *const i32).read_unaligned())
            };
            let mut sums = [[_mm512_setzero_si512(); 4]; R];
            match self.codes {
                Codes::Bytes => {
                    for (t, s) in (0..4)
                        .map(|t| _mm512_loadu_si512(self.start.as_ptr().add(pb * PANEL + 16 * t) as *const __m512i))
                        .enumerate()
                    {
                        for sa in sums.iter_mut() {
                            sa[t] = s;
                        }
                    }
                    for g in 0..8 {
                        let xs: [__m512i; R] = std::array::from_fn(|a| x(a, 4 * g));
                        for t in 0..4 {
                            let wv = _mm512_loadu_si512(w.add(g * 4 * PANEL + 64 * t) as *const __m512i);
                            for (sa, xa) in sums.iter_mut().zip(&xs) {
                                sa[t] = _mm512_dpbusd_epi32(sa[t], *xa, wv);
                            }
                        }
                    }
                }
                Codes::Nibbles if !unpacked.is_empty() => {
                    for (a, sa) in sums.iter_mut().enumerate() {
                        *sa = [_mm512_set1_epi32(xq.start[(i0 + a) * nb + b]); 4];
                    }
                    let u = unpacked[b * 8 * 4 * PANEL..(b + 1) * 8 * 4 * PANEL].as_ptr();
                    for g in 0..8 {
                        let xs: [__m512i; R] = std::array::from_fn(|a| x(a, 4 * g));
                        for t in 0..4 {
                            let wv = _mm512_loadu_si512(u.add(g * 4 * PANEL + 64 * t) as *const __m512i);
                            for (sa, xa) in sums.iter_mut().zip(&xs) {
                                sa[t] = _mm512_dpbusd_epi32(sa[t], wv, *xa);
                            }
                        }
                    }
                }
                Codes::Nibbles => {
                    for (a, sa) in sums.iter_mut().enumerate() {
                        *sa = [_mm512_set1_epi32(xq.start[(i0 + a) * nb + b]); 4];
                    }
                    for g in 0..4 {
                        let (xl, xh): ([__m512i; R], [__m512i; R]) =
                            (std::array::from_fn(|a| x(a, 4 * g)), std::array::from_fn(|a| x(a, 16 + 4 * g)));
                        for t in 0..4 {
                            let raw = _mm512_loadu_si512(w.add(g * 4 * PANEL + 64 * t) as *const __m512i);
                            let lo = _mm512_and_si512(raw, low);
                            let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), low);
                            for (a, sa) in sums.iter_mut().enumerate() {
                                sa[t] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sa[t], lo, xl[a]), hi, xh[a]);
                            }
                        }
                    }
                }
            }
            for (a, (acc_a, sa)) in acc.iter_mut().zip(&sums).enumerate() {
                let dx = _mm512_set1_ps(xq.d[(i0 + a) * nb + b]);
                for t in 0..4 {
                    let dw = _mm512_loadu_ps(self.d.as_ptr().add(pb * PANEL + 16 * t));
                    acc_a[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sa[t]), _mm512_mul_ps(dw, dx), acc_a[t]);
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

/// One matmul's view for `panels`: the weight and the quantized input rows.
struct QRun<'a> {
    mat: &'a QMatrix,
    xq: Q8Rows,
}

/// From this many input rows on, a Q4_0 panel's nibbles are expanded to bytes once per matmul instead of at every
/// pass of up to `ROWS` rows (a 512-row prefill would otherwise expand each code 171 times) — while the expanded
/// panel fits in L1 (48 KiB: inputs up to 768 wide). Wider panels stream from L2, where reading twice the bytes
/// cost more than the expansion saved (2,048-wide panels prefill 15% slower that way).
const UNPACK_MIN_ROWS: usize = 4 * ROWS;
const UNPACK_MAX_BYTES: usize = 48 << 10;

impl QMatrix {
    /// Panel `p`'s Q4_0 codes, one byte (0..15) each: block `b`, values `4g..4g + 4` of the 64 rows at
    /// `(b · 8 + g) · 256 + row · 4` — the byte layout of the Q8_0 panels.
    fn unpack(&self, p: usize, out: &mut Vec<u8>) {
        let nb = self.nb;
        out.resize(nb * 8 * 4 * PANEL, 0);
        let packed = &self.qs[p * nb * 4 * 4 * PANEL..(p + 1) * nb * 4 * 4 * PANEL];
        for (src, dst) in packed.chunks_exact(4 * 4 * PANEL).zip(out.chunks_exact_mut(8 * 4 * PANEL)) {
            let (low, high) = dst.split_at_mut(4 * 4 * PANEL);
            for ((&v, l), h) in src.iter().zip(low.iter_mut()).zip(high.iter_mut()) {
                (*l, *h) = (v & 0x0F, v >> 4);
            }
        }
    }
}

impl PanelKernel for QRun<'_> {
    type Scratch = Vec<u8>;

    fn prepare(&self, p: usize, m: usize, unpacked: &mut Vec<u8>) {
        if self.mat.codes == Codes::Nibbles && m >= UNPACK_MIN_ROWS && self.mat.nb * 8 * 4 * PANEL <= UNPACK_MAX_BYTES {
            self.mat.unpack(p, unpacked);
        }
    }

    fn block(&self, p: usize, unpacked: &Vec<u8>, i0: usize, rows: usize, out: &mut Block) {
        let mut done = 0;
        while done < rows {
            let (i, dst) = (i0 + done, &mut out[done..]);
            // SAFETY: a QMatrix exists only where the CPU has AVX-512 F/BW/VNNI (`QMatrix::new` checks
            // `isa::vnni`); `panels` keeps i0 + rows within m.
            unsafe {
                match rows - done {
                    1 => self.mat.panel_dots::<1>(&self.xq, p, i, unpacked, dst),
                    2 => self.mat.panel_dots::<2>(&self.xq, p, i, unpacked, dst),
                    _ => self.mat.panel_dots::<ROWS>(&self.xq, p, i, unpacked, dst),
                }
            }
            done += ROWS.min(rows - done);
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
        let pb = (r / PANEL) * self.nb;
        for (b, chunk) in out.chunks_exact_mut(QK).enumerate() {
            let d = self.d[(pb + b) * PANEL + r % PANEL];
            for (c, v) in chunk.iter_mut().enumerate() {
                let q = match self.codes {
                    Codes::Nibbles if c < 16 => (self.byte(r, b, c) & 0x0F) as i32 - 8,
                    Codes::Nibbles => (self.byte(r, b, c - 16) >> 4) as i32 - 8,
                    Codes::Bytes => self.byte(r, b, c) as i8 as i32,
                };
                *v = q as f32 * d;
            }
        }
    }

    /// `out (m, n) = x (m, k) · Wᵀ`.
    fn matmul(&self, x: &[f32], m: usize, out: &mut [f32]) {
        let k = self.k;
        assert!(x.len() == m * k && out.len() == m * self.n, "matmul buffer sizes do not match ({m}, {k}, {})", self.n);
        let xq = Q8Rows::quantize(x, m, k, self.codes);
        panels(&QRun { mat: self, xq }, m, self.n, m * self.n * k, out);
    }
}

/// One block of 32 activations as ggml's AVX code quantizes it: `d = amax / 127`, `q = round(x / d)` to nearest
/// (ties to even, the vector unit's mode), saturated to i8. Returns `d` (before its f16 rounding).
///
/// # Safety
/// The CPU must have AVX-512 F (a QMatrix exists only where it has AVX-512 VNNI).
#[target_feature(enable = "avx512f")]
unsafe fn quantize_block(xb: &[f32], q: &mut [i8; QK]) -> f32 {
    assert_eq!(xb.len(), QK);
    // xb holds 32 floats and q 32 bytes (checked above).
    let (a, b) = (_mm512_loadu_ps(xb.as_ptr()), _mm512_loadu_ps(xb.as_ptr().add(16)));
    let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    let d = amax / 127.0;
    let id = _mm512_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
    let round = |v| {
        _mm512_cvtsepi32_epi8(_mm512_cvt_roundps_epi32::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(v, id),
        ))
    };
    _mm_storeu_si128(q.as_mut_ptr() as *mut __m128i, round(a));
    _mm_storeu_si128(q.as_mut_ptr().add(16) as *mut __m128i, round(b));
    d
}

impl Q8Rows {
    fn quantize(x: &[f32], m: usize, k: usize, codes: Codes) -> Self {
        let nb = k / QK;
        let mut qs = vec![0u8; m * nb * QK];
        let mut d = vec![0f32; m * nb];
        let mut start = vec![0i32; if codes == Codes::Nibbles { m * nb } else { 0 }];
        let mut q = [0i8; QK];
        for i in 0..m {
            for b in 0..nb {
                let ib = i * nb + b;
                // SAFETY: a QMatrix, whose inputs these are, exists only where the CPU has AVX-512 VNNI.
                let scale = unsafe { quantize_block(&x[ib * QK..(ib + 1) * QK], &mut q) };
                d[ib] = f16::from_f32(scale).to_f32();
                let dst = &mut qs[ib * QK..(ib + 1) * QK];
                match codes {
                    Codes::Bytes => dst.iter_mut().zip(&q).for_each(|(o, &v)| *o = (v as i32 + 128) as u8),
                    Codes::Nibbles => {
                        dst.iter_mut().zip(&q).for_each(|(o, &v)| *o = v as u8);
                        start[ib] = -8 * q.iter().map(|&v| v as i32).sum::<i32>();
                    }
                }
            }
        }
        Self { qs, d, start }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::GgmlDType;
    use candle_core::{Device, Tensor};

    #[test]
    fn matmul_matches_ggml_arithmetic_and_is_independent_of_the_row_count() {
        if !isa::vnni() {
            return; // the kernel runs only with AVX-512 VNNI
        }
        // m = 14 and 20 run Q4_0 over codes expanded once per matmul (from 12 rows on); the rest expand per pass.
        let shapes = [(20, 64, 1), (33, 96, 6), (70, 704, 9), (130, 64, 14), (65, 96, 20)];
        for (&(n, k, m), (dtype, codes)) in
            shapes.iter().flat_map(|s| [(s, (GgmlDType::Q4_0, Codes::Nibbles)), (s, (GgmlDType::Q8_0, Codes::Bytes))])
        {
            let w: Vec<f32> = (0..n * k).map(|i| (i * 7919 % 1000) as f32 / 500.0 - 1.0).collect();
            let q = QTensor::quantize(&Tensor::from_vec(w, (n, k), &Device::Cpu).unwrap(), dtype).unwrap();
            let mat = QMatrix::new(&q, codes).unwrap();
            let x: Vec<f32> = (0..m * k).map(|i| (i * 104729 % 997) as f32 / 400.0 - 1.2).collect();
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
                    assert!(
                        (got - want).abs() < 1e-4 * (1.0 + want.abs()),
                        "({i}, {j}) of ({n}, {k}): {got} vs {want}"
                    );
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
