//! How the KV cache stores one head row of K or V, per cache mode:
//!
//! | mode   | element | per row metadata            | value                              |
//! |--------|---------|-----------------------------|------------------------------------|
//! | f32    | f32     | —                           | x                                  |
//! | f16    | f16     | —                           | x                                  |
//! | int8   | i8      | f32 scale                   | scale · q, q ∈ [-127, 127]         |
//! | int4   | u8 = two 4-bit codes (low nibble first) | f16 scale, f16 min | min + scale · q, q ∈ [0, 15] |
//!
//! int8 is symmetric per token and head; int4 is asymmetric with one group per token and head (the whole head row,
//! 64 values for the default model), which keeps the metadata at 4 bytes per row: 36 bytes per 64-value row, 0.28×
//! of f16. "int4-h" stores the same int4 rows after a Hadamard rotation of each head (see `hadamard`).
//! Attention never materializes decoded rows: `dot` and `axpy` work on the stored codes.

use half::f16;
use half::slice::HalfFloatSliceExt;

#[cfg(target_arch = "x86_64")]
use crate::kernels::isa;
#[cfg(target_arch = "x86_64")]
use crate::kernels::simd::hsum;

pub trait KvElem: Copy + Send + Sync + Default + 'static {
    /// Values per stored element (2 for packed int4).
    const PACK: usize = 1;
    /// Per-row metadata kept next to the elements (`()` for plain floats).
    type Meta: Copy + Default + Send + Sync + 'static;
    /// Store one head row (`out.len() == row.len() / PACK`); returns its metadata.
    fn encode_row(row: &[f32], out: &mut [Self]) -> Self::Meta;
    /// `q · row`; `q_sum` is `Σ q` (used by offset-carrying types).
    fn dot(row: &[Self], meta: Self::Meta, q: &[f32], q_sum: f32) -> f32;
    /// `out += w · row`.
    fn axpy(row: &[Self], meta: Self::Meta, w: f32, out: &mut [f32]);
    /// `out = Σ_i weights[i] · row(rows[i])` over stored rows of `w` elements, accumulated in `rows` order.
    fn weighted_sum(
        values: &[Self],
        meta: &[Self::Meta],
        w: usize,
        rows: impl Iterator<Item = usize> + Clone,
        weights: &[f32],
        out: &mut [f32],
    ) {
        axpy_rows(values, meta, w, rows, weights, out);
    }
    /// The stored rows as f16 when that is what they are (for `attn_f16`'s blocked attention); `None` otherwise.
    #[cfg(target_arch = "x86_64")]
    fn as_f16(_rows: &[Self]) -> Option<&[f16]> {
        None
    }
}

/// `weighted_sum` as `axpy` row after row (the default, and the f16 fallback for widths the wide path skips).
fn axpy_rows<T: KvElem>(
    values: &[T],
    meta: &[T::Meta],
    w: usize,
    rows: impl Iterator<Item = usize>,
    weights: &[f32],
    out: &mut [f32],
) {
    out.fill(0.0);
    for (&p, t) in weights.iter().zip(rows) {
        T::axpy(&values[t * w..(t + 1) * w], meta[t], p, out);
    }
}

/// Lanes of the dot products below: independent partial sums the compiler keeps in one vector register.
const LANES: usize = 16;

/// `Σ row_i · q_i` in `LANES` partial sums (summed in order at the end), so it vectorizes.
#[inline]
fn dot_lanes<T: Copy + Into<f32>>(row: &[T], q: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let (rc, qc) = (row.chunks_exact(LANES), q.chunks_exact(LANES));
    let tail: f32 = rc.remainder().iter().zip(qc.remainder()).map(|(&a, b)| a.into() * b).sum();
    for (r, q) in rc.zip(qc) {
        for l in 0..LANES {
            acc[l] += r[l].into() * q[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

impl KvElem for f32 {
    type Meta = ();
    fn encode_row(row: &[f32], out: &mut [Self]) {
        out.copy_from_slice(row);
    }
    #[inline]
    fn dot(row: &[Self], _: (), q: &[f32], _: f32) -> f32 {
        dot_lanes(row, q)
    }
    #[inline]
    fn axpy(row: &[Self], _: (), w: f32, out: &mut [f32]) {
        out.iter_mut().zip(row).for_each(|(o, x)| *o += w * x);
    }
}

impl KvElem for f16 {
    type Meta = ();
    fn encode_row(row: &[f32], out: &mut [Self]) {
        out.iter_mut().zip(row).for_each(|(o, &x)| *o = f16::from_f32(x));
    }
    #[inline]
    fn dot(row: &[Self], _: (), q: &[f32], _: f32) -> f32 {
        f16_dot(row, q)
    }
    #[inline]
    fn axpy(row: &[Self], _: (), w: f32, out: &mut [f32]) {
        f16_axpy(row, w, out)
    }
    #[cfg(target_arch = "x86_64")]
    fn as_f16(rows: &[Self]) -> Option<&[f16]> {
        Some(rows)
    }
    /// With AVX-512 and head rows a multiple of 64 wide, each 64-wide piece of `out` stays in four registers while
    /// the rows stream past (the same fused multiply-adds in the same order as `axpy` row after row).
    fn weighted_sum(
        values: &[Self],
        meta: &[()],
        w: usize,
        rows: impl Iterator<Item = usize> + Clone,
        weights: &[f32],
        out: &mut [f32],
    ) {
        #[cfg(target_arch = "x86_64")]
        if isa::avx512() && w.is_multiple_of(F16_WIDE) && out.len() == w {
            // SAFETY: the CPU has AVX-512 F (`isa::avx512`); the widths were just checked.
            return unsafe { f16_weighted_sum_avx512(values, w, rows, weights, out) };
        }
        axpy_rows(values, meta, w, rows, weights, out)
    }
}

/// Columns of `out` an AVX-512 weighted sum keeps in registers: four vectors.
#[cfg(target_arch = "x86_64")]
const F16_WIDE: usize = 4 * LANES;

/// The f16 `weighted_sum` of rows `F16_WIDE` columns at a time (`w` a multiple of it, `out.len() == w`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn f16_weighted_sum_avx512(
    values: &[f16],
    w: usize,
    rows: impl Iterator<Item = usize> + Clone,
    weights: &[f32],
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    const WIDE: usize = F16_WIDE;
    for c in (0..w).step_by(WIDE) {
        // Each row t is values[t*w..(t+1)*w] (bounds-checked below) and c + WIDE <= w, so every load and store
        // stays inside its slice.
        let mut acc = [_mm512_setzero_ps(); 4];
        for (&p, t) in weights.iter().zip(rows.clone()) {
            let row = &values[t * w + c..t * w + c + WIDE];
            let pv = _mm512_set1_ps(p);
            for (j, a) in acc.iter_mut().enumerate() {
                let v = _mm512_cvtph_ps(_mm256_loadu_si256(row.as_ptr().add(j * LANES) as *const __m256i));
                *a = _mm512_fmadd_ps(pv, v, *a);
            }
        }
        for (j, a) in acc.iter().enumerate() {
            _mm512_storeu_ps(out.as_mut_ptr().add(c + j * LANES), *a);
        }
    }
}

/// `Σ row_i · q_i`: 16 lanes of fused multiply-adds over f16 widened in registers, reduced at the end by
/// `simd::hsum` (the same fixed order for every row, and the same float as `attn_f16`'s blocked scores, so a
/// score never depends on which other rows are attended alongside or which path computed it).
#[inline]
fn f16_dot(row: &[f16], q: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa::avx512() {
        // SAFETY: the CPU has AVX-512 F (`isa::avx512`).
        return unsafe { f16_dot_avx512(row, q) };
    }
    f16_dot_portable(row, q)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn f16_dot_avx512(row: &[f16], q: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = row.len().min(q.len());
    let full = n - n % LANES;
    // Every load reads LANES elements below `full` <= both lengths.
    let head = {
        let mut acc = _mm512_setzero_ps();
        for c in (0..full).step_by(LANES) {
            let k = _mm512_cvtph_ps(_mm256_loadu_si256(row.as_ptr().add(c) as *const __m256i));
            acc = _mm512_fmadd_ps(k, _mm512_loadu_ps(q.as_ptr().add(c)), acc);
        }
        hsum(acc)
    };
    head + row[full..n].iter().zip(&q[full..n]).map(|(a, b)| a.to_f32() * b).sum::<f32>()
}

/// `out += w · row`, 16 lanes at a time.
#[inline]
fn f16_axpy(row: &[f16], w: f32, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa::avx512() {
        // SAFETY: the CPU has AVX-512 F (`isa::avx512`).
        return unsafe { f16_axpy_avx512(row, w, out) };
    }
    f16_axpy_portable(row, w, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn f16_axpy_avx512(row: &[f16], w: f32, out: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = row.len().min(out.len());
    let full = n - n % LANES;
    // As in f16_dot; stores write LANES elements below `full` <= out.len().
    let wv = _mm512_set1_ps(w);
    for c in (0..full).step_by(LANES) {
        let v = _mm512_cvtph_ps(_mm256_loadu_si256(row.as_ptr().add(c) as *const __m256i));
        let o = out.as_mut_ptr().add(c);
        _mm512_storeu_ps(o, _mm512_fmadd_ps(wv, v, _mm512_loadu_ps(o)));
    }
    out[full..n].iter_mut().zip(&row[full..n]).for_each(|(o, x)| *o += w * x.to_f32());
}

#[inline]
fn f16_dot_portable(row: &[f16], q: &[f32]) -> f32 {
    let mut wide = [0f32; LANES];
    let mut acc = [0f32; LANES];
    let (rc, qc) = (row.chunks_exact(LANES), q.chunks_exact(LANES));
    let tail: f32 = rc.remainder().iter().zip(qc.remainder()).map(|(a, b)| a.to_f32() * b).sum();
    for (r, q) in rc.zip(qc) {
        r.convert_to_f32_slice(&mut wide);
        for l in 0..LANES {
            acc[l] += wide[l] * q[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[inline]
fn f16_axpy_portable(row: &[f16], w: f32, out: &mut [f32]) {
    let mut wide = [0f32; LANES];
    let mut oc = out.chunks_exact_mut(LANES);
    let mut rc = row.chunks_exact(LANES);
    for (o, r) in oc.by_ref().zip(rc.by_ref()) {
        r.convert_to_f32_slice(&mut wide);
        for l in 0..LANES {
            o[l] += w * wide[l];
        }
    }
    oc.into_remainder().iter_mut().zip(rc.remainder()).for_each(|(o, x)| *o += w * x.to_f32());
}

impl KvElem for i8 {
    type Meta = f32;
    fn encode_row(row: &[f32], out: &mut [Self]) -> f32 {
        let amax = row.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        let scale = amax / 127.0;
        let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
        for (o, &x) in out.iter_mut().zip(row) {
            *o = (x * inv).round().clamp(-127.0, 127.0) as i8;
        }
        scale
    }
    #[inline]
    fn dot(row: &[Self], scale: f32, q: &[f32], _: f32) -> f32 {
        scale * dot_lanes(row, q)
    }
    #[inline]
    fn axpy(row: &[Self], scale: f32, w: f32, out: &mut [f32]) {
        let w = w * scale;
        out.iter_mut().zip(row).for_each(|(o, &x)| *o += w * x as f32);
    }
}

/// Two 4-bit codes per byte: value `2i` in the low nibble, `2i + 1` in the high one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct Nibbles(pub u8);

/// int4 row metadata: `value = min + scale · code`, both stored as f16.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Int4Meta {
    pub scale: f16,
    pub min: f16,
}

impl KvElem for Nibbles {
    const PACK: usize = 2;
    type Meta = Int4Meta;
    fn encode_row(row: &[f32], out: &mut [Self]) -> Int4Meta {
        let (lo, hi) = row.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &x| (a.min(x), b.max(x)));
        // Quantize against the f16-rounded parameters, so that what is stored is what the codes were fitted to.
        let min = f16::from_f32(lo);
        let scale = f16::from_f32((hi - min.to_f32()) / 15.0);
        let (m, s) = (min.to_f32(), scale.to_f32());
        let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
        let code = |x: f32| ((x - m) * inv).round().clamp(0.0, 15.0) as u8;
        for (o, pair) in out.iter_mut().zip(row.chunks_exact(2)) {
            *o = Nibbles(code(pair[0]) | (code(pair[1]) << 4));
        }
        Int4Meta { scale, min }
    }
    #[inline]
    fn dot(row: &[Self], meta: Int4Meta, q: &[f32], q_sum: f32) -> f32 {
        let acc: f32 = row
            .iter()
            .zip(q.chunks_exact(2))
            .map(|(b, qq)| (b.0 & 15) as f32 * qq[0] + (b.0 >> 4) as f32 * qq[1])
            .sum();
        meta.scale.to_f32() * acc + meta.min.to_f32() * q_sum
    }
    #[inline]
    fn axpy(row: &[Self], meta: Int4Meta, w: f32, out: &mut [f32]) {
        let (ws, wm) = (w * meta.scale.to_f32(), w * meta.min.to_f32());
        for (b, o) in row.iter().zip(out.chunks_exact_mut(2)) {
            o[0] += wm + ws * (b.0 & 15) as f32;
            o[1] += wm + ws * (b.0 >> 4) as f32;
        }
    }
}

/// In-place orthonormal Walsh–Hadamard transform (Sylvester order, scaled by 1/√n) of a power-of-two-long row.
/// It is its own inverse, and `(Hq)·(Hk) = q·k`: rotating both queries and keys leaves attention scores unchanged,
/// and attention over rotated values yields the rotated output, which one more transform undoes. The rotation
/// spreads an outlier channel over the whole row, so a per-row int4 grid wastes fewer levels on it.
pub fn hadamard(x: &mut [f32]) {
    let n = x.len();
    debug_assert!(n.is_power_of_two());
    let mut h = 1;
    while h < n {
        for block in x.chunks_exact_mut(2 * h) {
            let (a, b) = block.split_at_mut(h);
            for (u, v) in a.iter_mut().zip(b.iter_mut()) {
                let (s, d) = (*u + *v, *u - *v);
                *u = s;
                *v = d;
            }
        }
        h *= 2;
    }
    let norm = 1.0 / (n as f32).sqrt();
    x.iter_mut().for_each(|v| *v *= norm);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(n: usize, seed: u32) -> Vec<f32> {
        (0..n).map(|i| ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 997) as f32 / 100.0 - 5.0).collect()
    }

    fn decode<T: KvElem>(codes: &[T], meta: T::Meta, n: usize) -> Vec<f32> {
        let mut out = vec![0.0; n];
        T::axpy(codes, meta, 1.0, &mut out);
        out
    }

    #[test]
    fn int4_round_trip_is_within_half_a_step_and_dot_matches_decoded() {
        let x = row(64, 7);
        let mut codes = vec![Nibbles::default(); 32];
        let meta = Nibbles::encode_row(&x, &mut codes);
        let back = decode(&codes, meta, 64);
        let step = meta.scale.to_f32();
        assert!(x.iter().zip(&back).all(|(a, b)| (a - b).abs() <= 0.5 * step + 1e-2), "{x:?} {back:?}");
        let q = row(64, 3);
        let want: f32 = back.iter().zip(&q).map(|(a, b)| a * b).sum();
        let got = Nibbles::dot(&codes, meta, &q, q.iter().sum());
        assert!((got - want).abs() < 1e-3 * want.abs().max(1.0), "{got} vs {want}");
    }

    #[test]
    fn int4_constant_row_is_exact() {
        let x = vec![1.5f32; 64];
        let mut codes = vec![Nibbles::default(); 32];
        let meta = Nibbles::encode_row(&x, &mut codes);
        assert_eq!(decode(&codes, meta, 64), x);
    }

    #[test]
    fn hadamard_is_orthonormal_and_self_inverse() {
        let (q, k) = (row(64, 1), row(64, 2));
        let (mut hq, mut hk) = (q.clone(), k.clone());
        hadamard(&mut hq);
        hadamard(&mut hk);
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
        assert!((dot(&q, &k) - dot(&hq, &hk)).abs() < 1e-3);
        hadamard(&mut hq);
        assert!(hq.iter().zip(&q).all(|(a, b)| (a - b).abs() < 1e-5));
        // A single spike becomes a flat row.
        let mut spike = vec![0.0f32; 16];
        spike[3] = 4.0;
        hadamard(&mut spike);
        assert!(spike.iter().all(|v| (v.abs() - 1.0).abs() < 1e-6));
    }

    #[test]
    fn f16_weighted_sum_is_axpy_row_after_row_and_dot_matches_f64() {
        for w in [64, 128, 48] {
            let n = 37;
            let vals: Vec<f16> = row(n * w, 7).iter().map(|&x| f16::from_f32(x)).collect();
            let weights: Vec<f32> = row(n, 3).iter().map(|x| x.abs()).collect();
            let rows: Vec<usize> = (0..n).rev().step_by(2).collect();
            let mut expect = vec![0f32; w];
            for (&p, &t) in weights.iter().zip(&rows) {
                f16::axpy(&vals[t * w..(t + 1) * w], (), p, &mut expect);
            }
            let mut got = vec![1f32; w];
            f16::weighted_sum(&vals, &vec![(); n], w, rows.iter().copied(), &weights, &mut got);
            assert_eq!(got, expect, "w = {w}");
            let q = row(w, 11);
            let exact: f64 = vals[..w].iter().zip(&q).map(|(a, b)| a.to_f64() * *b as f64).sum();
            assert!((f16::dot(&vals[..w], (), &q, 0.0) as f64 - exact).abs() < 1e-4 * (1.0 + exact.abs()));
        }
    }
}
