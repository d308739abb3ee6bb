//! Q4_0 and Q8_0 weights × Q8_0-quantized inputs, for any number of input rows (decode, verification, batched
//! decode, prefill). candle runs Q4_0 (and Q8_0 rows whose width is not a multiple of 256) through a generic
//! per-block dot product; llama.cpp repacks and runs tiled kernels, several times faster at prefill. This is
//! tinyloop's own:
//!
//! - inputs are quantized per 32-value block exactly as ggml's x86 code does (`d = amax / 127` stored as f16,
//!   `x / d` rounded to nearest, ties to even), so the arithmetic is the one llama.cpp runs on the same weights;
//! - weights are repacked at load into panels of 64 rows (`kernels::panels`): for each block, each group of 4 input
//!   positions holds the 64 rows' 4 codes side by side — one 64-byte vector per 16 rows — with the rows' f32
//!   scales next to them;
//! - a body for the CPU's level (`Body`: `avx512` with VNNI, `avx2`) multiplies a vector of rows' 4 codes by 4 input
//!   bytes broadcast to every lane, so each lane collects one output's exact integer block sum (Q4_0: unsigned
//!   nibbles × signed inputs, less 8 · Σx; Q8_0: codes × inputs); the block sum then takes one fused multiply-add
//!   with `d_x · d_w` into the output's f32 lane. No horizontal sums; an output never depends on how many rows are
//!   multiplied together, or which — batched == solo, bit for bit — nor on the body that computed it.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod layout;
#[cfg(target_arch = "aarch64")]
mod neon;

use half::f16;

use crate::kernels::panels::{panels, Block, PanelKernel, PANEL};
use crate::kernels::Kernel;
pub use layout::{Body, Codes, QMatrix};
use layout::{Q8Rows, QK};

/// Input rows one pass of the AVX-512 body over a panel's blocks serves (their integer and float accumulators fill
/// the registers).
const ROWS: usize = 3;

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
        let (mat, xq) = (self.mat, &self.xq);
        // SAFETY: a QMatrix holds a body only where the CPU runs it (`Body::best`); `panels` keeps i0 + rows
        // within m.
        unsafe {
            match mat.body {
                #[cfg(target_arch = "aarch64")]
                Body::NeonDot => {
                    for (a, dst) in out[..rows].iter_mut().enumerate() {
                        neon::panel_dots(mat, xq, p, i0 + a, unpacked, dst);
                    }
                }
                #[cfg(target_arch = "x86_64")]
                Body::Avx2 => {
                    for (a, dst) in out[..rows].iter_mut().enumerate() {
                        avx2::panel_dots(mat, xq, p, i0 + a, unpacked, dst);
                    }
                }
                #[cfg(target_arch = "x86_64")]
                Body::Avx512Vnni => {
                    let mut done = 0;
                    while done < rows {
                        let (i, dst) = (i0 + done, &mut out[done..]);
                        match rows - done {
                            1 => avx512::panel_dots::<1>(mat, xq, p, i, unpacked, dst),
                            2 => avx512::panel_dots::<2>(mat, xq, p, i, unpacked, dst),
                            _ => avx512::panel_dots::<ROWS>(mat, xq, p, i, unpacked, dst),
                        }
                        done += ROWS.min(rows - done);
                    }
                }
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
        let xq = Q8Rows::quantize(x, m, k, self.codes, self.body);
        panels(&QRun { mat: self, xq }, m, self.n, m * self.n * k, out);
    }
}

impl Q8Rows {
    fn quantize(x: &[f32], m: usize, k: usize, codes: Codes, body: Body) -> Self {
        let nb = k / QK;
        let mut qs = vec![0u8; m * nb * QK];
        let mut d = vec![0f32; m * nb];
        let mut start = vec![0i32; if codes == Codes::Nibbles { m * nb } else { 0 }];
        let mut q = [0i8; QK];
        for i in 0..m {
            for b in 0..nb {
                let ib = i * nb + b;
                let xb = &x[ib * QK..(ib + 1) * QK];
                // SAFETY: the matrix whose inputs these are holds a body only where the CPU runs it.
                let scale = unsafe {
                    match body {
                        #[cfg(target_arch = "x86_64")]
                        Body::Avx512Vnni => avx512::quantize_block(xb, &mut q),
                        #[cfg(target_arch = "x86_64")]
                        Body::Avx2 => avx2::quantize_block(xb, &mut q),
                        #[cfg(target_arch = "aarch64")]
                        Body::NeonDot => neon::quantize_block(xb, &mut q),
                    }
                };
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
    use candle_core::quantized::{GgmlDType, QStorage, QTensor};
    use candle_core::{Device, Tensor};

    /// Every body this CPU runs, best first; `TINYLOOP_ISA` does not limit a test that names its bodies.
    fn bodies() -> Vec<Body> {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            let avx2 = has!("avx2") && has!("fma");
            let vnni = avx2 && has!("avx512f") && has!("avx512bw") && has!("avx512vnni");
            [(Body::Avx512Vnni, vnni), (Body::Avx2, avx2)].into_iter().filter(|&(_, on)| on).map(|(b, _)| b).collect()
        }
        #[cfg(target_arch = "aarch64")]
        {
            let dot = std::arch::is_aarch64_feature_detected!("dotprod");
            if dot {
                vec![Body::NeonDot]
            } else {
                vec![]
            }
        }
    }

    /// An `(n, k)` matrix of `dtype` whose block `b` of row `r` has scale `0.01 · (1 + (r + b) % 5)` and codes
    /// `code(r, b, c)` (`c` the block byte).
    fn raw_matrix(dtype: GgmlDType, n: usize, k: usize, code: impl Fn(usize, usize, usize) -> u8) -> QTensor {
        let bytes = dtype.type_size() - 2;
        let mut raw = Vec::new();
        for r in 0..n {
            for b in 0..k / QK {
                raw.extend_from_slice(&f16::from_f32(0.01 * (1 + (r + b) % 5) as f32).to_le_bytes());
                raw.extend((0..bytes).map(|c| code(r, b, c)));
            }
        }
        let storage = QStorage::from_data(std::borrow::Cow::Owned(raw), &Device::Cpu, dtype).unwrap();
        QTensor::new(storage, (n, k)).unwrap()
    }

    #[test]
    fn extreme_codes_and_inputs_do_not_saturate_any_body() {
        // Inputs that quantize to ±127 (d = 1.5 / 127) against codes at the ends of their ranges: the largest
        // 16-bit sums the AVX2 body forms. Q8_0 codes over the whole byte range, −128 included (no quantizer
        // writes it, a file may hold it); Q4_0 nibbles all 15 or 0 under inputs of one sign.
        let (n, k, m) = (64, 256, 2);
        let cases = [
            (
                GgmlDType::Q8_0,
                Codes::Bytes,
                (|i| if (i / 3).is_multiple_of(2) { 1.5 } else { -1.5 }) as fn(usize) -> f32,
            ),
            (GgmlDType::Q4_0, Codes::Nibbles, |i| if (i / QK).is_multiple_of(2) { 1.5 } else { -1.5 }),
        ];
        for (dtype, codes, input) in cases {
            let q = raw_matrix(dtype, n, k, |r, b, c| match codes {
                Codes::Bytes if (r + c) % 3 == 0 => 0x80,
                Codes::Bytes => ((r * 31 + b * 7 + c * 13) % 256) as u8,
                Codes::Nibbles if r % 2 == 0 => 0xFF,
                Codes::Nibbles => 0x00,
            });
            let x: Vec<f32> = (0..m * k).map(input).collect();
            let deq = q.dequantize(&Device::Cpu).unwrap().to_vec2::<f32>().unwrap();
            let dx = f16::from_f32(1.5 / 127.0).to_f32() as f64;
            let mut first: Option<Vec<f32>> = None;
            for body in bodies() {
                let mut out = vec![0f32; m * n];
                QMatrix::with_body(&q, codes, body).unwrap().matmul(&x, m, &mut out);
                for (i, j) in (0..m).flat_map(|i| (0..n).map(move |j| (i, j))) {
                    let want: f64 = (0..k).map(|c| deq[j][c] as f64 * x[i * k + c].signum() as f64 * 127.0 * dx).sum();
                    let got = out[i * n + j] as f64;
                    assert!(
                        (got - want).abs() < 1e-4 * (1.0 + want.abs()),
                        "{dtype:?} {body:?} ({i}, {j}): {got} vs {want}"
                    );
                }
                match &first {
                    None => first = Some(out),
                    Some(f) => assert_eq!(&out, f, "{dtype:?}: {body:?} differs from the best body"),
                }
            }
        }
    }

    #[test]
    fn matmul_matches_ggml_arithmetic_and_is_independent_of_the_row_count_and_the_body() {
        // Every body this CPU runs; `TINYLOOP_ISA` does not limit a test that names its bodies.
        let bodies = bodies();
        if bodies.is_empty() {
            return; // the kernel needs AVX2 at least
        }
        // m = 14 and 20 run Q4_0 over codes expanded once per matmul (from 12 rows on); the rest expand per pass.
        let shapes = [(20, 64, 1), (33, 96, 6), (70, 704, 9), (130, 64, 14), (65, 96, 20)];
        for (&(n, k, m), (dtype, codes)) in
            shapes.iter().flat_map(|s| [(s, (GgmlDType::Q4_0, Codes::Nibbles)), (s, (GgmlDType::Q8_0, Codes::Bytes))])
        {
            let w: Vec<f32> = (0..n * k).map(|i| (i * 7919 % 1000) as f32 / 500.0 - 1.0).collect();
            let q = QTensor::quantize(&Tensor::from_vec(w, (n, k), &Device::Cpu).unwrap(), dtype).unwrap();
            let x: Vec<f32> = (0..m * k).map(|i| (i * 104729 % 997) as f32 / 400.0 - 1.2).collect();
            let run = |body| {
                let mat = QMatrix::with_body(&q, codes, body).unwrap();
                let mut all = vec![0f32; m * n];
                mat.matmul(&x, m, &mut all);
                (mat, all)
            };
            let (mat, all) = run(bodies[0]);
            for &body in &bodies[1..] {
                assert_eq!(run(body).1, all, "{body:?} and {:?} differ ({n}, {k}, {m}, {dtype:?})", bodies[0]);
            }
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
