//! Vector passes over one row of logits, for the sampler: the maximum and the argmax, `exp((x − max) / T)` with block sums, the
//! mass below a threshold, and the ids at or above one. Each touches the vocabulary once, 16 lanes at a time with
//! AVX-512 (`simd::exp16`, within 2 ulp of libm's `expf`), so that a sampled token costs a few passes over 200 KB
//! rather than a sort of the whole vocabulary. Below AVX-512 (`isa::avx512`) the same results come from portable
//! loops.

#[cfg(target_arch = "x86_64")]
use super::isa;

/// Ids per block of `exp_weights`' block sums: a draw finds its block among ~50 sums, then its id among 1024 weights.
pub const BLOCK: usize = 1024;

/// The largest value, ignoring NaN (−∞ for an empty or all-NaN row).
pub fn max_value(x: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 16];
    let chunks = x.chunks_exact(16);
    let tail = chunks.remainder();
    for c in chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = if v > *m { v } else { *m };
        }
    }
    lanes.iter().chain(tail).fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m })
}

/// Index of the largest logit; the lowest index among equals (NaN never wins; all NaN gives 0): the largest value
/// 16 lanes at a time (`max_value`), then its first position.
pub fn argmax(logits: &[f32]) -> u32 {
    let max = max_value(logits);
    logits.iter().position(|&v| v == max).unwrap_or(0) as u32
}

/// `out[i] = exp((x[i] − max) · inv_t)` for every i (0 for −∞ and NaN), and in `blocks` the sum of each run of
/// `BLOCK` weights (f32 lanes within a block, f64 across blocks). Returns the total.
pub fn exp_weights(x: &[f32], max: f32, inv_t: f32, out: &mut Vec<f32>, blocks: &mut Vec<f64>) -> f64 {
    out.resize(x.len(), 0.0);
    blocks.clear();
    for (xb, ob) in x.chunks(BLOCK).zip(out.chunks_mut(BLOCK)) {
        blocks.push(exp_block(xb, max, inv_t, ob) as f64);
    }
    blocks.iter().sum()
}

/// `exp_block` 16 lanes at a time: loads and stores stay inside the slices (the tail through a mask). NaN compares
/// false in `x ≥ −∞`, so it and −∞ (e⁻∞ = 0 anyway) are zeroed by the mask.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_block_avx512(x: &[f32], max: f32, inv_t: f32, out: &mut [f32]) -> f32 {
    use std::arch::x86_64::*;
    let (m, s, lowest) = (_mm512_set1_ps(max), _mm512_set1_ps(inv_t), _mm512_set1_ps(f32::MIN));
    let mut acc = _mm512_setzero_ps();
    for (xc, oc) in x.chunks(16).zip(out.chunks_mut(16)) {
        let load: __mmask16 = if xc.len() == 16 { !0 } else { (1u16 << xc.len()) - 1 };
        let v = _mm512_maskz_loadu_ps(load, xc.as_ptr());
        let finite = _mm512_mask_cmp_ps_mask::<_CMP_GE_OQ>(load, v, lowest);
        let e = _mm512_maskz_mov_ps(finite, super::simd::exp16(_mm512_mul_ps(_mm512_sub_ps(v, m), s)));
        _mm512_mask_storeu_ps(oc.as_mut_ptr(), load, e);
        acc = _mm512_add_ps(acc, e);
    }
    _mm512_reduce_add_ps(acc)
}

fn exp_block(x: &[f32], max: f32, inv_t: f32, out: &mut [f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa::avx512() {
        // SAFETY: the CPU has AVX-512 F (`isa::avx512`).
        return unsafe { exp_block_avx512(x, max, inv_t, out) };
    }
    let mut sum = 0.0f32;
    for (o, &v) in out.iter_mut().zip(x) {
        *o = if v >= f32::MIN { ((v - max) * inv_t).exp() } else { 0.0 };
        sum += *o;
    }
    sum
}

/// `Σ exp((x[i] − max) · inv_t)` over the finite x[i] < `below`.
pub fn exp_sum_below(x: &[f32], max: f32, inv_t: f32, below: f32) -> f64 {
    x.chunks(BLOCK).map(|b| exp_sum_below_block(b, max, inv_t, below) as f64).sum()
}

/// `exp_sum_below_block` 16 lanes at a time; loads stay inside `x` (the tail through a mask).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_sum_below_block_avx512(x: &[f32], max: f32, inv_t: f32, below: f32) -> f32 {
    use std::arch::x86_64::*;
    let (m, s) = (_mm512_set1_ps(max), _mm512_set1_ps(inv_t));
    let (lowest, limit) = (_mm512_set1_ps(f32::MIN), _mm512_set1_ps(below));
    let mut acc = _mm512_setzero_ps();
    for c in x.chunks(16) {
        let load: __mmask16 = if c.len() == 16 { !0 } else { (1u16 << c.len()) - 1 };
        let v = _mm512_maskz_loadu_ps(load, c.as_ptr());
        let keep =
            _mm512_mask_cmp_ps_mask::<_CMP_LT_OQ>(_mm512_mask_cmp_ps_mask::<_CMP_GE_OQ>(load, v, lowest), v, limit);
        if keep != 0 {
            let e = super::simd::exp16(_mm512_mul_ps(_mm512_sub_ps(v, m), s));
            acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(keep, e));
        }
    }
    _mm512_reduce_add_ps(acc)
}

fn exp_sum_below_block(x: &[f32], max: f32, inv_t: f32, below: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa::avx512() {
        // SAFETY: the CPU has AVX-512 F (`isa::avx512`).
        return unsafe { exp_sum_below_block_avx512(x, max, inv_t, below) };
    }
    x.iter().filter(|&&v| v >= f32::MIN && v < below).map(|&v| ((v - max) * inv_t).exp()).sum()
}

/// How many x[i] are ≥ `at_least` (a count of `ids_at_least` without the ids).
pub fn count_at_least(x: &[f32], at_least: f32) -> usize {
    #[cfg(target_arch = "x86_64")]
    if isa::avx512() {
        // SAFETY: the CPU has AVX-512 F (`isa::avx512`).
        return unsafe { count_at_least_avx512(x, at_least) };
    }
    x.iter().filter(|&&v| v >= at_least).count()
}

/// `count_at_least` 16 lanes at a time; loads stay inside `x` (the tail through a mask).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn count_at_least_avx512(x: &[f32], at_least: f32) -> usize {
    use std::arch::x86_64::*;
    let limit = _mm512_set1_ps(at_least);
    let mut n = 0;
    for c in x.chunks(16) {
        let load: __mmask16 = if c.len() == 16 { !0 } else { (1u16 << c.len()) - 1 };
        let v = _mm512_maskz_loadu_ps(load, c.as_ptr());
        n += _mm512_mask_cmp_ps_mask::<_CMP_GE_OQ>(load, v, limit).count_ones() as usize;
    }
    n
}

/// Logits per group of `group_maxima`.
pub const GROUP: usize = 16;

/// The largest value of each group of `GROUP` logits (NaN ignored; −∞ for a group with nothing else), into `out`
/// (cleared first). Which logits share a group does not matter to the caller — each belongs to exactly one — so with
/// AVX-512 a group is one lane of 16 consecutive vectors: a 256-logit block gives 16 maxima in 16 `vmaxps`.
pub fn group_maxima(x: &[f32], out: &mut Vec<f32>) {
    out.clear();
    #[cfg(target_arch = "x86_64")]
    if isa::avx512() {
        // SAFETY: the CPU has AVX-512 F (`isa::avx512`).
        return unsafe { group_maxima_avx512(x, out) };
    }
    out.extend(x.chunks(GROUP).map(|c| c.iter().fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m })));
}

/// `group_maxima` with a group in each lane of 16 consecutive vectors; loads stay inside `x` (the tail through a
/// mask, −∞ elsewhere). `vmaxps` returns its second operand when either is NaN, so a NaN logit leaves the running
/// maximum as it was.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn group_maxima_avx512(x: &[f32], out: &mut Vec<f32>) {
    use std::arch::x86_64::*;
    let lowest = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut lanes = [0f32; 16];
    for block in x.chunks(GROUP * 16) {
        let mut acc = lowest;
        for c in block.chunks(16) {
            let load: __mmask16 = if c.len() == 16 { !0 } else { (1u16 << c.len()) - 1 };
            acc = _mm512_max_ps(_mm512_mask_loadu_ps(lowest, load, c.as_ptr()), acc);
        }
        _mm512_storeu_ps(lanes.as_mut_ptr(), acc);
        out.extend_from_slice(&lanes);
    }
}

/// The ids i with x[i] ≥ `at_least`, ascending, into `out` (cleared first).
pub fn ids_at_least(x: &[f32], at_least: f32, out: &mut Vec<u32>) {
    out.clear();
    #[cfg(target_arch = "x86_64")]
    if isa::avx512() {
        // SAFETY: the CPU has AVX-512 F (`isa::avx512`).
        return unsafe { ids_at_least_avx512(x, at_least, out) };
    }
    out.extend((0..x.len() as u32).filter(|&i| x[i as usize] >= at_least));
}

/// `ids_at_least` 16 lanes at a time: loads stay inside `x` (the tail through a mask); `out` has room for x.len()
/// ids, each chunk stores at most its own 16 at `out`'s end, and the length is set to what was stored.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn ids_at_least_avx512(x: &[f32], at_least: f32, out: &mut Vec<u32>) {
    use std::arch::x86_64::*;
    out.reserve(x.len());
    let (limit, lane) =
        (_mm512_set1_ps(at_least), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    let mut n = 0;
    for (i, c) in x.chunks(16).enumerate() {
        let load: __mmask16 = if c.len() == 16 { !0 } else { (1u16 << c.len()) - 1 };
        let hits = _mm512_mask_cmp_ps_mask::<_CMP_GE_OQ>(load, _mm512_maskz_loadu_ps(load, c.as_ptr()), limit);
        if hits != 0 {
            let idx = _mm512_add_epi32(lane, _mm512_set1_epi32((i * 16) as i32));
            _mm512_mask_compressstoreu_epi32(out.as_mut_ptr().add(n).cast(), hits, idx);
            n += hits.count_ones() as usize;
        }
    }
    out.set_len(n);
}

/// `Σ w[j]` over the ids ahead of `id` in descending order of `x` (ties: lower id first): x[j] > x[id], or
/// x[j] = x[id] with j < id. Summed in f64 (each f32 weight widened), so the sum carries only the weights' own
/// rounding. With AVX-512, 16 lanes at a time; ids before `id` are compared with ≥, the rest with >.
pub fn mass_ahead(x: &[f32], w: &[f32], id: usize) -> f64 {
    let ((x_lower, x_upper), (w_lower, w_upper)) = (x.split_at(id), w.split_at(id));
    mass_where::<true>(x_lower, w_lower, x[id]) + mass_where::<false>(x_upper, w_upper, x[id])
}

/// `Σ w[j]` over x[j] ≥ `pivot` (`OR_EQUAL`) or x[j] > `pivot`.
fn mass_where<const OR_EQUAL: bool>(x: &[f32], w: &[f32], pivot: f32) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if isa::avx512() {
        // SAFETY: the CPU has AVX-512 F (`isa::avx512`).
        return unsafe { mass_where_avx512::<OR_EQUAL>(x, w, pivot) };
    }
    x.iter().zip(w).filter(|(&v, _)| v > pivot || (OR_EQUAL && v == pivot)).map(|(_, &m)| m as f64).sum()
}

/// `mass_where` 16 lanes at a time: `x` and `w` have one length and loads stay inside them (the tail through a
/// mask).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn mass_where_avx512<const OR_EQUAL: bool>(x: &[f32], w: &[f32], pivot: f32) -> f64 {
    use std::arch::x86_64::*;
    let p = _mm512_set1_ps(pivot);
    let (mut lo, mut hi) = (_mm512_setzero_pd(), _mm512_setzero_pd());
    for (xc, wc) in x.chunks(16).zip(w.chunks(16)) {
        let load: __mmask16 = if xc.len() == 16 { !0 } else { (1u16 << xc.len()) - 1 };
        let v = _mm512_maskz_loadu_ps(load, xc.as_ptr());
        let hit = if OR_EQUAL {
            _mm512_mask_cmp_ps_mask::<_CMP_GE_OQ>(load, v, p)
        } else {
            _mm512_mask_cmp_ps_mask::<_CMP_GT_OQ>(load, v, p)
        };
        if hit != 0 {
            let wv = _mm512_maskz_loadu_ps(hit, wc.as_ptr());
            lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(wv)));
            hi =
                _mm512_add_pd(hi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(wv)))));
        }
    }
    _mm512_reduce_add_pd(_mm512_add_pd(lo, hi))
}

/// `bucket[j] = min(255, ⌊(hi − x[j]) · scale⌋)`: the histogram bin of each logit (a monotone function of it).
pub fn buckets(x: &[f32], hi: f32, scale: f32, out: &mut Vec<u8>) {
    out.clear();
    out.extend(x.iter().map(|&v| ((hi - v) * scale).clamp(0.0, 255.0) as u8));
}

/// `out[j] = exp((x[j] − max) · inv_t)` in f64, for logits gathered into `x` (all finite). With AVX-512 8 lanes at a
/// time: x = n·ln 2 + r, |r| ≤ ln 2 / 2, a degree-13 Taylor polynomial for eʳ (truncation below 2·10⁻¹⁶) and 2ⁿ by
/// `vscalefpd` — within a few ulp of libm's `exp`, where the f32 weights of `exp_weights` carry 2 ulp of f32.
pub fn exp_f64(x: &[f32], max: f32, inv_t: f64, out: &mut Vec<f64>) {
    out.clear();
    out.resize(x.len(), 0.0);
    #[cfg(target_arch = "x86_64")]
    if isa::avx512() {
        // SAFETY: the CPU has AVX-512 F and VL (`isa::avx512`).
        return unsafe { exp_f64_avx512(x, max, inv_t, out) };
    }
    out.iter_mut().zip(x).for_each(|(o, &v)| *o = ((v as f64 - max as f64) * inv_t).exp());
}

/// `exp_f64` 8 lanes at a time; loads and stores stay inside the slices (the tail through a mask).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl")]
unsafe fn exp_f64_avx512(x: &[f32], max: f32, inv_t: f64, out: &mut [f64]) {
    use std::arch::x86_64::*;
    let (m, s) = (_mm512_set1_pd(max as f64), _mm512_set1_pd(inv_t));
    for (xc, oc) in x.chunks(8).zip(out.chunks_mut(8)) {
        let mask: __mmask8 = if xc.len() == 8 { !0 } else { (1u8 << xc.len()) - 1 };
        let v = _mm512_cvtps_pd(_mm256_maskz_loadu_ps(mask, xc.as_ptr()));
        _mm512_mask_storeu_pd(oc.as_mut_ptr(), mask, exp8(_mm512_mul_pd(_mm512_sub_pd(v, m), s)));
    }
}

/// 1/d! for d = 0..=13: the Taylor coefficients of `exp8`.
#[cfg(target_arch = "x86_64")]
const INV_FACTORIAL: [f64; 14] = {
    let (mut c, mut d) = ([1.0f64; 14], 1);
    while d < 14 {
        c[d] = c[d - 1] / d as f64;
        d += 1;
    }
    c
};

/// `eˣ` in 8 f64 lanes (see `exp_f64`); x is clamped to [−745, 709] (0 and finite large values at the ends).
///
/// # Safety
/// The CPU must have AVX-512 F (`isa::avx512`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn exp8(x: std::arch::x86_64::__m512d) -> std::arch::x86_64::__m512d {
    use std::arch::x86_64::*;
    let x = _mm512_min_pd(_mm512_max_pd(x, _mm512_set1_pd(-745.0)), _mm512_set1_pd(709.0));
    let n = _mm512_roundscale_pd::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_pd(
        x,
        _mm512_set1_pd(std::f64::consts::LOG2_E),
    ));
    // ln 2 split as fdlibm splits it: a high part with 32 trailing zero bits (n · high is exact) and the rest.
    let r = _mm512_fnmadd_pd(n, _mm512_set1_pd(f64::from_bits(0x3fe6_2e42_fee0_0000)), x);
    let r = _mm512_fnmadd_pd(n, _mm512_set1_pd(f64::from_bits(0x3dea_39ef_3579_3c76)), r);
    let mut p = _mm512_set1_pd(INV_FACTORIAL[13]);
    for &c in INV_FACTORIAL[..13].iter().rev() {
        p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(c));
    }
    _mm512_scalef_pd(p, n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(n: usize) -> Vec<f32> {
        let mut x: Vec<f32> =
            (0..n).map(|i| ((i as u32).wrapping_mul(2654435761) % 2003) as f32 / 97.0 - 10.0).collect();
        x[3] = f32::NEG_INFINITY;
        x[n / 2] = f32::NAN;
        x
    }

    #[test]
    fn passes_match_scalar_f64() {
        for n in [1usize, 7, 16, 1000, 1024, 1025, 5000] {
            let x = if n > 8 { row(n) } else { vec![0.5; n] };
            let max = x.iter().copied().filter(|v| !v.is_nan()).fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(max_value(&x), max);
            let inv_t = 1.0 / 0.7f32;
            let want: Vec<f64> =
                x.iter().map(|&v| if v.is_nan() { 0.0 } else { ((v - max) as f64 * inv_t as f64).exp() }).collect();
            let (mut w, mut blocks) = (Vec::new(), Vec::new());
            let total = exp_weights(&x, max, inv_t, &mut w, &mut blocks);
            assert_eq!(blocks.len(), n.div_ceil(BLOCK));
            for ((g, e), &v) in w.iter().zip(&want).zip(&x) {
                // (x − max) · inv_t is rounded to f32 first: a relative error of ~1e-7 of the exponent.
                let arg = if v.is_finite() { ((v - max) * inv_t).abs() as f64 } else { 0.0 };
                assert!((*g as f64 - e).abs() <= (1e-6 + 2e-7 * arg) * e + 1e-30, "{g} vs {e}");
            }
            let sum: f64 = want.iter().sum();
            assert!((total - sum).abs() <= 1e-5 * sum);
            let below = 0.3 * max - 1.0;
            let masked: f64 = x.iter().zip(&want).filter(|(v, _)| **v < below).map(|(_, e)| e).sum();
            assert!((exp_sum_below(&x, max, inv_t, below) - masked).abs() <= 1e-5 * masked + 1e-30);
            let finite: Vec<f32> = x.iter().copied().filter(|v| v.is_finite()).collect();
            let mut w64 = Vec::new();
            exp_f64(&finite, max, inv_t as f64, &mut w64);
            for (&g, &v) in w64.iter().zip(&finite) {
                let e = ((v as f64 - max as f64) * inv_t as f64).exp();
                assert!((g - e).abs() <= 4.0 * f64::EPSILON * e, "exp({}) = {g}, want {e}", v - max);
            }
            // Ties on the grid of `row`: the pivot's equals count ahead of it only from lower ids.
            for id in [0, 3, n / 2, n - 1, n / 3].into_iter().filter(|&i| i < n) {
                let pivot = x[id];
                let ahead = |j: usize| x[j] > pivot || (x[j] == pivot && j < id);
                let want: f64 = (0..n).filter(|&j| ahead(j)).map(|j| w[j] as f64).sum();
                assert!((mass_ahead(&x, &w, id) - want).abs() <= 1e-12 * want, "id {id}");
            }
            let mut ids = Vec::new();
            ids_at_least(&x, below, &mut ids);
            let expected: Vec<u32> = (0..n as u32).filter(|&i| x[i as usize] >= below).collect();
            assert_eq!(ids, expected);
            assert_eq!(count_at_least(&x, below), expected.len());
            // Each logit in one group: as many maxima as groups (x.len() / 16, rounded up to whole 256-blocks with
            // AVX-512), and for any threshold, k maxima at or above it mean k to 16k logits at or above it.
            let mut maxima = Vec::new();
            group_maxima(&x, &mut maxima);
            assert!(maxima.len() >= n.div_ceil(GROUP) && maxima.len() <= n.div_ceil(GROUP * 16) * 16);
            assert_eq!(max_value(&maxima), max);
            for threshold in [max, below, max - 3.0, f32::MIN] {
                let (groups, logits) = (count_at_least(&maxima, threshold), count_at_least(&x, threshold));
                assert!(groups <= logits && logits <= GROUP * groups, "{threshold}: {groups} groups, {logits} logits");
            }
        }
    }
}
