//! The AVX-512 VNNI body of the Q4_0 / Q8_0 kernel: `vpdpbusd` multiplies 16 rows' 4 codes by 4 input bytes
//! broadcast to every lane (Q4_0: unsigned nibbles × signed inputs; Q8_0: inputs + 128 × signed codes, less
//! 128 · Σw), up to three input rows per pass over a panel.

use std::arch::x86_64::*;

use super::layout::{Codes, Q8Rows, QMatrix, QK};
use crate::kernels::panels::PANEL;

/// `out[a][o]` for input rows `i0..i0 + R` and panel `p`.
/// `unpacked`: Q4_0 only, the panel's codes as one byte each (`unpack`), or empty to expand the nibbles here.
// 87 lines: the hot kernel keeps its accumulators in registers across the three code layouts' inner loops.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn panel_dots<const R: usize>(
    m: &QMatrix,
    xq: &Q8Rows,
    p: usize,
    i0: usize,
    unpacked: &[u8],
    out: &mut [[f32; PANEL]],
) {
    let (nb, bb) = (m.nb, m.codes.block_bytes());
    assert!(xq.d.len() >= (i0 + R) * nb && m.d.len() >= (p + 1) * nb * PANEL && out.len() >= R);
    let low = _mm512_set1_epi8(0x0F);
    let mut acc = [[_mm512_setzero_ps(); 4]; R];
    for b in 0..nb {
        let pb = p * nb + b;
        let w = m.qs.as_ptr().add(pb * PANEL * bb);
        let x = |a: usize, t: usize| {
            let at = xq.qs.as_ptr().add(((i0 + a) * nb + b) * QK + t);
            _mm512_set1_epi32((at as *const i32).read_unaligned())
        };
        let mut sums = [[_mm512_setzero_si512(); 4]; R];
        match m.codes {
            Codes::Bytes => {
                for (t, s) in (0..4)
                    .map(|t| _mm512_loadu_si512(m.start.as_ptr().add(pb * PANEL + 16 * t) as *const __m512i))
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
                let dw = _mm512_loadu_ps(m.d.as_ptr().add(pb * PANEL + 16 * t));
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

/// One block of 32 activations as ggml's AVX code quantizes it: `d = amax / 127`, `q = round(x / d)` to nearest
/// (ties to even, the vector unit's mode), saturated to i8. Returns `d` (before its f16 rounding).
///
/// # Safety
/// The CPU must have AVX-512 F (a QMatrix exists only where it has AVX-512 VNNI).
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn quantize_block(xb: &[f32], q: &mut [i8; QK]) -> f32 {
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
