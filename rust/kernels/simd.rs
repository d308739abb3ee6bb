//! Vector math shared by attention (`kv`, `attn_f16`) and the SwiGLU gate (`model`): `eˣ` 16 lanes at a time, the
//! softmax built on it, and the fixed-order horizontal sum every f16 attention score ends with. Without AVX-512
//! (`isa::avx512`) the callers use libm's `expf`.

#[cfg(target_arch = "x86_64")]
use super::isa;

/// Lanes of the vectors below.
#[cfg(target_arch = "x86_64")]
const LANES: usize = 16;

/// `eˣ` in 16 lanes: x = n·ln 2 + r with |r| ≤ ln 2 / 2 (ln 2 split in two so n·ln 2 is exact), a degree-6
/// polynomial for eʳ (Cephes' `expf` coefficients) and 2ⁿ applied by `vscalefps`, which also gives the subnormals,
/// 0 below e⁻¹⁰⁴ and +∞ above e⁸⁸·⁷ (x is clamped to [−104, 104] first, so ±∞ in gives 0 / +∞, never NaN). Within
/// 2 ulp of libm's `expf` (tested over [−104, 88]).
///
/// # Safety
/// The CPU must have AVX-512 F (`isa::avx512`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) unsafe fn exp16(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0)), _mm512_set1_ps(104.0));
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
        x,
        _mm512_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm512_set1_ps(1.987_569_1e-4);
    for c in [1.398_2e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    let p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0)));
    _mm512_scalef_ps(p, n)
}

/// `gate[i] = silu(gate[i]) · up[i] = gate[i] / (1 + e^−gate[i]) · up[i]` (the SwiGLU feed-forward's gate).
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "silu_mul lengths");
    #[cfg(target_arch = "x86_64")]
    if isa::avx512() {
        // SAFETY: the CPU has AVX-512 F (`isa::avx512`).
        return unsafe { silu_mul_avx512(gate, up) };
    }
    gate.iter_mut().zip(up).for_each(|(g, u)| *g = *g / (1.0 + (-*g).exp()) * u);
}

/// `silu_mul` 16 lanes at a time; masked loads and stores stay inside both slices.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn silu_mul_avx512(gate: &mut [f32], up: &[f32]) {
    use std::arch::x86_64::*;
    let one = _mm512_set1_ps(1.0);
    for (g, u) in gate.chunks_mut(16).zip(up.chunks(16)) {
        let mask: __mmask16 = if g.len() == 16 { !0 } else { (1u16 << g.len()) - 1 };
        let gv = _mm512_maskz_loadu_ps(mask, g.as_ptr());
        let e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        let v = _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), _mm512_maskz_loadu_ps(mask, u.as_ptr()));
        _mm512_mask_storeu_ps(g.as_mut_ptr(), mask, v);
    }
}

/// The sum of a vector's 16 lanes, pairing lanes (i, i+8), then (i, i+4), (i, i+2), (i, i+1) — the order of each
/// lane of `attn_f16::reduce_16x16`.
///
/// # Safety
/// The CPU must have AVX-512 F (`isa::avx512`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
pub unsafe fn hsum(a: std::arch::x86_64::__m512) -> f32 {
    use std::arch::x86_64::*;
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a)));
    let b = _mm256_add_ps(_mm512_castps512_ps256(a), hi);
    let c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps::<1>(b));
    let d = _mm_add_ps(c, _mm_movehl_ps(c, c));
    _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)))
}

/// `s = softmax(s)` in place: `exp(s_i − max)`, summed, each divided by the sum. With AVX-512 the exponentials
/// take 16 lanes at a time (`exp16`, within 2 ulp of libm's `expf`) and the sum 16 lane-sums reduced at the end;
/// elsewhere libm's `expf` and one running sum. Either way a fixed order that depends only on the scores.
pub fn softmax_in_place(s: &mut [f32]) {
    let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum = exp_minus_and_sum(s, max);
    s.iter_mut().for_each(|v| *v /= sum);
}

/// `(log softmax(z), softmax(z))`, from one pass of exponentials (`exp_minus_and_sum`).
pub fn log_softmax(z: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut p = z.to_vec();
    let sum = exp_minus_and_sum(&mut p, max);
    let shift = max + sum.ln();
    let inv = 1.0 / sum;
    p.iter_mut().for_each(|v| *v *= inv);
    (z.iter().map(|v| v - shift).collect(), p)
}

fn exp_minus_and_sum(s: &mut [f32], max: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa::avx512() {
        // SAFETY: the CPU has AVX-512 F (`isa::avx512`).
        return unsafe { exp_minus_and_sum_avx512(s, max) };
    }
    let mut sum = 0.0f32;
    for v in s.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    sum
}

/// `exp_minus_and_sum` 16 lanes at a time; loads and stores stay inside `s` (the tail through a mask).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_minus_and_sum_avx512(s: &mut [f32], max: f32) -> f32 {
    use std::arch::x86_64::*;
    let (m, mut acc) = (_mm512_set1_ps(max), _mm512_setzero_ps());
    for chunk in s.chunks_mut(LANES) {
        let mask: __mmask16 = if chunk.len() == LANES { !0 } else { (1u16 << chunk.len()) - 1 };
        let e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, chunk.as_ptr()), m));
        _mm512_mask_storeu_ps(chunk.as_mut_ptr(), mask, e);
        acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(mask, e));
    }
    _mm512_reduce_add_ps(acc)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pseudo(n: usize, seed: u32) -> Vec<f32> {
        (0..n).map(|i| ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 997) as f32 / 100.0 - 5.0).collect()
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn exp16_is_within_two_ulp_of_f64_and_saturates() {
        use std::arch::x86_64::*;
        if !isa::avx512() {
            return; // nothing to check below AVX-512
        }
        let mut xs: Vec<f32> = (0..192_000).map(|i| -104.0 + i as f32 * 1e-3).collect(); // -104 up to 88
        xs.extend([0.0, -0.0, -1e-30, 1e-30, -87.3, -103.0, 88.5, -150.0, f32::NEG_INFINITY, f32::MIN]);
        xs.extend([89.0, 1e4, f32::MAX, f32::INFINITY, 0.0, 0.0]);
        for chunk in xs.chunks_exact(16) {
            let mut got = [0f32; 16];
            // SAFETY: the CPU has AVX-512 F (checked above); 16 values in, 16 out.
            unsafe { _mm512_storeu_ps(got.as_mut_ptr(), exp16(_mm512_loadu_ps(chunk.as_ptr()))) };
            for (&x, &g) in chunk.iter().zip(&got) {
                let want = (x as f64).exp();
                if want > f32::MAX as f64 {
                    assert_eq!(g, f32::INFINITY, "exp({x})");
                    continue;
                }
                let ulp = (want as f32).abs().max(f32::MIN_POSITIVE) as f64 * f32::EPSILON as f64;
                assert!((g as f64 - want).abs() <= 2.0 * ulp + 1e-45, "exp({x}) = {g}, want {want}");
            }
        }
    }

    #[test]
    fn silu_mul_matches_f64() {
        let gate: Vec<f32> = (0..37).map(|i| (i as f32 - 18.0) * 0.7).chain([-200.0, 200.0, 0.0]).collect();
        let up: Vec<f32> = (0..gate.len()).map(|i| 0.5 + i as f32 * 0.1).collect();
        let mut got = gate.clone();
        silu_mul(&mut got, &up);
        for ((&g, &u), &v) in gate.iter().zip(&up).zip(&got) {
            let want = g as f64 / (1.0 + (-g as f64).exp()) * u as f64;
            assert!((v as f64 - want).abs() <= 1e-6 * (1.0 + want.abs()), "silu({g}) * {u} = {v}, want {want}");
        }
    }

    #[test]
    fn softmax_matches_f64() {
        for n in [1, 5, 16, 37, 300] {
            let mut s: Vec<f32> = pseudo(n, 5).iter().map(|x| x * 3.0).collect();
            let max = s.iter().copied().fold(f64::NEG_INFINITY, |m, v| m.max(v as f64));
            let e: Vec<f64> = s.iter().map(|&v| (v as f64 - max).exp()).collect();
            let total: f64 = e.iter().sum();
            softmax_in_place(&mut s);
            for (got, want) in s.iter().zip(&e) {
                assert!(
                    (*got as f64 - want / total).abs() <= 1e-6 * (want / total) + 1e-12,
                    "{got} vs {}",
                    want / total
                );
            }
        }
    }

    #[test]
    fn log_softmax_matches_f64() {
        for n in [1, 5, 16, 37, 4096] {
            let z: Vec<f32> = pseudo(n, 9).iter().map(|x| x * 3.0).collect();
            let max = z.iter().copied().fold(f64::NEG_INFINITY, |m, v| m.max(v as f64));
            let lse = max + z.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
            let (logp, p) = log_softmax(&z);
            // The f32 sum of up to 4,096 terms (one running sum without AVX-512) is good to a few parts in 10⁶.
            for ((&v, &lp), &pr) in z.iter().zip(&logp).zip(&p) {
                let want = v as f64 - lse;
                assert!((lp as f64 - want).abs() <= 1e-5, "{lp} vs {want}");
                assert!((pr as f64 - want.exp()).abs() <= 1e-5 * want.exp() + 1e-12, "{pr} vs {}", want.exp());
            }
        }
    }
}
