//! The AVX2 body of the Q4_0 / Q8_0 kernel, for CPUs without AVX-512 VNNI. AVX2 has no 4-byte dot product into
//! 32-bit lanes, so each `vpdpbusd` of the VNNI body becomes `vpmaddubsw` (unsigned × signed byte pairs summed to
//! 16 bits) and `vpmaddwd` by ones (pairs of those summed to 32 bits). The 16-bit step must not saturate:
//!
//! - Q4_0: nibbles 0..15 × inputs −127..127: a whole block's products, 16 per 16-bit lane, sum to at most
//!   16 · 15 · 127 = 30,480, so they are widened once per block;
//! - Q8_0: |code| (0..128) × input · sign(code), as llama.cpp's AVX2 code does: at most 2 · 128 · 127 = 32,512.
//!
//! Each lane still collects one output's exact integer block sum and takes the same fused multiply-add as in the
//! VNNI body, so both bodies give the same bits. With half as many registers as AVX-512, a pass covers one input
//! row and the whole panel — its eight 8-lane integer block sums in registers, its float accumulators in the
//! output row (in L1) — so the panel streams from memory in order.

use std::arch::x86_64::*;

use super::layout::{Codes, Q8Rows, QMatrix, QK};
use crate::kernels::panels::PANEL;

/// `out[o]` for input row `i` and panel `p`; `unpacked` as in the VNNI body.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn panel_dots(m: &QMatrix, xq: &Q8Rows, p: usize, i: usize, unpacked: &[u8], out: &mut [f32; PANEL]) {
    let (nb, bb) = (m.nb, m.codes.block_bytes());
    assert!(xq.d.len() >= (i + 1) * nb && m.d.len() >= (p + 1) * nb * PANEL);
    assert!(unpacked.is_empty() || unpacked.len() >= nb * 8 * 4 * PANEL);
    let (low, ones, flip) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi16(1), _mm256_set1_epi8(-128));
    // 16-bit pair sums to 32-bit lanes, added to `s`.
    let widen = |s: __m256i, pairs: __m256i| _mm256_add_epi32(s, _mm256_madd_epi16(pairs, ones));
    *out = [0.0; PANEL];
    for b in 0..nb {
        let (pb, ib) = (p * nb + b, i * nb + b);
        // Vector `t` of group `g`: rows 8t.., each row's 4 bytes side by side.
        let at = |codes: *const u8, g: usize, t: usize| {
            _mm256_loadu_si256(codes.add(g * 4 * PANEL + 32 * t) as *const __m256i)
        };
        let x = |t: usize| _mm256_set1_epi32((xq.qs.as_ptr().add(ib * QK + t) as *const i32).read_unaligned());
        let sums = match m.codes {
            Codes::Bytes => {
                let mut sums = [_mm256_setzero_si256(); 8];
                let w = m.qs.as_ptr().add(pb * PANEL * bb);
                for g in 0..8 {
                    // The inputs are stored + 128 for the VNNI body; back to signed.
                    let xs = _mm256_xor_si256(x(4 * g), flip);
                    for (t, s) in sums.iter_mut().enumerate() {
                        let wv = at(w, g, t);
                        *s = widen(*s, _mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(xs, wv)));
                    }
                }
                sums
            }
            Codes::Nibbles => {
                // A block's nibble products fit 16 bits (module doc): one widening per block.
                let mut pairs = [_mm256_setzero_si256(); 8];
                if unpacked.is_empty() {
                    let w = m.qs.as_ptr().add(pb * PANEL * bb);
                    for g in 0..4 {
                        let (xl, xh) = (x(4 * g), x(16 + 4 * g));
                        for (t, s) in pairs.iter_mut().enumerate() {
                            let raw = at(w, g, t);
                            let lo = _mm256_maddubs_epi16(_mm256_and_si256(raw, low), xl);
                            let hi = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16::<4>(raw), low), xh);
                            *s = _mm256_add_epi16(*s, _mm256_add_epi16(lo, hi));
                        }
                    }
                } else {
                    let u = unpacked.as_ptr().add(b * 8 * 4 * PANEL);
                    for g in 0..8 {
                        let xg = x(4 * g);
                        for (t, s) in pairs.iter_mut().enumerate() {
                            *s = _mm256_add_epi16(*s, _mm256_maddubs_epi16(at(u, g, t), xg));
                        }
                    }
                }
                let start = _mm256_set1_epi32(xq.start[ib]);
                pairs.map(|p| widen(start, p))
            }
        };
        // The float accumulators live in `out` (in L1): the registers hold the block's integer sums.
        let dx = _mm256_set1_ps(xq.d[ib]);
        for (t, s) in sums.iter().enumerate() {
            let (o, dw) = (out.as_mut_ptr().add(8 * t), _mm256_loadu_ps(m.d.as_ptr().add(pb * PANEL + 8 * t)));
            _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_cvtepi32_ps(*s), _mm256_mul_ps(dw, dx), _mm256_loadu_ps(o)));
        }
    }
}

/// One block of 32 activations quantized as the VNNI body's `quantize_block` does it, bit for bit: `d = amax / 127`,
/// `q = round(x / d)` to nearest (ties to even), saturated to i8. Returns `d` (before its f16 rounding).
///
/// # Safety
/// The CPU must have AVX2.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn quantize_block(xb: &[f32], q: &mut [i8; QK]) -> f32 {
    assert_eq!(xb.len(), QK);
    let v: [__m256; 4] = std::array::from_fn(|j| _mm256_loadu_ps(xb.as_ptr().add(8 * j)));
    let sign = _mm256_set1_ps(-0.0);
    let abs = |j: usize| _mm256_andnot_ps(sign, v[j]);
    let m8 = _mm256_max_ps(_mm256_max_ps(abs(0), abs(1)), _mm256_max_ps(abs(2), abs(3)));
    let m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps::<1>(m8));
    let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
    let d = amax / 127.0;
    let id = _mm256_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
    // Rounded under the default MXCSR mode, to nearest even.
    let r: [__m256i; 4] = std::array::from_fn(|j| _mm256_cvtps_epi32(_mm256_mul_ps(v[j], id)));
    let bytes = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
    // The packs work within 128-bit halves: put the 4-byte groups back in order.
    let ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, ordered);
    d
}
