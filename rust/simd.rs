//! Vector math shared by the attention softmax (`kv_elem`) and the SwiGLU gate (`model`): `eˣ` 16 lanes at a time.
//! Without AVX-512 the callers use libm's `expf`.

/// `eˣ` in 16 lanes: x = n·ln 2 + r with |r| ≤ ln 2 / 2 (ln 2 split in two so n·ln 2 is exact), a degree-6
/// polynomial for eʳ (Cephes' `expf` coefficients) and 2ⁿ applied by `vscalefps`, which also gives the subnormals,
/// 0 below e⁻¹⁰⁴ and +∞ above e⁸⁸·⁷ (x is clamped to [−104, 104] first, so ±∞ in gives 0 / +∞, never NaN). Within
/// 2 ulp of libm's `expf` (tested over [−104, 88]).
///
/// # Safety
/// The CPU must have AVX-512 F (the callers' cfg).
#[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
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
    #[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
    // SAFETY: avx512f is enabled at compile time; masked loads and stores stay inside both slices.
    unsafe {
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
    #[cfg(not(all(target_arch = "x86_64", target_feature = "avx512f")))]
    gate.iter_mut().zip(up).for_each(|(g, u)| *g = *g / (1.0 + (-*g).exp()) * u);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
    #[test]
    fn exp16_is_within_two_ulp_of_f64_and_saturates() {
        use std::arch::x86_64::*;
        let mut xs: Vec<f32> = (0..192_000).map(|i| -104.0 + i as f32 * 1e-3).collect(); // -104 up to 88
        xs.extend([0.0, -0.0, -1e-30, 1e-30, -87.3, -103.0, 88.5, -150.0, f32::NEG_INFINITY, f32::MIN]);
        xs.extend([89.0, 1e4, f32::MAX, f32::INFINITY, 0.0, 0.0]);
        for chunk in xs.chunks_exact(16) {
            let mut got = [0f32; 16];
            // SAFETY: the cfg above; 16 values in, 16 out.
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
}
