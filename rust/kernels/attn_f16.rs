//! Attention over an f16 KV cache (the "fp16" mode) for query rows that see contiguous index ranges: prefill
//! chunks, self-speculative verification and plain decode (tree verification, whose rows see scattered ancestors,
//! goes through `kv::attend_one`). With AVX-512 only (`isa::avx512`).
//!
//! Up to `ROWS` query rows of one head are attended together. Scores take 16 keys at a time: the keys are widened to
//! f32 once into a scratch block that every row reads from L1, each (row, key) pair gets one 16-lane multiply-add
//! chain over the head, and one transposing tree reduces 16 chains to 16 scores in a vector (`reduce_16x16`), where a
//! key-by-key reduction spent more instructions on horizontal sums than on the products. Values are widened once per
//! key for all rows, with each row's 64-wide piece of the output in four registers.
//!
//! A score is the same float whichever way it is computed — by the tree, by `hsum` of one chain (the keys past the
//! last full block, and `kv::elem::f16_dot`), alone or in a block of rows — and each output lane adds its value rows
//! in index order, as `KvElem::weighted_sum` does. So a row's output never depends on the rows attended alongside it
//! (batched, chunked, verified or decoded alone: the same bits).

use std::arch::x86_64::*;

use half::f16;
use rayon::prelude::*;

use super::isa;
use super::simd::{hsum, softmax_in_place};
use super::AttnShape;
use crate::limits::ATTN_PARALLEL_MIN;

const LANES: usize = 16;
/// Query rows attended together (`ROWS` × 4 accumulators + 4 value registers fit in the 32 vector registers).
pub const ROWS: usize = 6;

/// Lane j of the result is `hsum(a[j])`, bit for bit, for 16 vectors at once (45 shuffles and adds instead of 16
/// reductions). Each level adds the same lane pairs as `hsum`; the pairing of keys at level one puts key j in lane j.
///
/// # Safety
/// As `hsum`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn reduce_16x16(a: &[__m512; LANES]) -> __m512 {
    // Level 1: [x(i) + x(i+8) for 8 lanes | y(i) + y(i+8)].
    let l1 = |x, y| _mm512_add_ps(_mm512_shuffle_f32x4::<0x44>(x, y), _mm512_shuffle_f32x4::<0xEE>(x, y));
    // Level 2: per 128-bit lane, 4-lane sums (i, i+4) of the four keys of two level-1 vectors.
    let l2 = |x, y| _mm512_add_ps(_mm512_shuffle_f32x4::<0x88>(x, y), _mm512_shuffle_f32x4::<0xDD>(x, y));
    // Level 3: (i, i+2) within each 128-bit lane; level 4: (i, i+1).
    let l3 = |x, y| _mm512_add_ps(_mm512_shuffle_ps::<0x44>(x, y), _mm512_shuffle_ps::<0xEE>(x, y));
    let l4 = |x, y| _mm512_add_ps(_mm512_shuffle_ps::<0x88>(x, y), _mm512_shuffle_ps::<0xDD>(x, y));
    // Lane 4l + m of the result comes from 128-bit lane l of the m-th level-2 vector, which holds keys m, m+4, m+8,
    // m+12 in its four 128-bit lanes.
    let u = |m: usize| l2(l1(a[m], a[m + 4]), l1(a[m + 8], a[m + 12]));
    l4(l3(u(0), u(1)), l3(u(2), u(3)))
}

/// Query rows of one head with what each sees: row r reads `q[r]` and attends to indices `ranges[r]`.
pub struct Rows<'a> {
    pub q: [&'a [f32]; ROWS],
    pub ranges: [(usize, usize); ROWS],
    pub n: usize,
}

/// Reused buffers of one worker: the widened key block and the rows' scores.
#[derive(Default)]
pub struct Scratch {
    keys: Vec<f32>,
    scores: Vec<f32>,
}

/// `out[r] = softmax(q[r]·Kᵀ·scale)·V` over `rows.ranges[r]` for the `rows.n` rows; `keys`, `values`: one head's
/// `[index][hd]` rows. `hd` must be a multiple of 64 and every range non-empty.
///
/// # Safety
/// As `hsum`. Ranges must lie inside `keys` / `values`, `q[r]` and `out[r]` must hold `hd` values.
// 77 lines: the hot kernel's score, softmax and value phases share one scratch block and stay one unit.
#[target_feature(enable = "avx512f")]
pub unsafe fn attend_rows(
    keys: &[f16],
    values: &[f16],
    hd: usize,
    scale: f32,
    rows: &Rows,
    out: &mut [&mut [f32]],
    scratch: &mut Scratch,
) {
    let n = rows.n;
    debug_assert!(hd.is_multiple_of(64) && n <= ROWS && out.len() >= n);
    let lo = rows.ranges[..n].iter().map(|r| r.0).min().unwrap_or(0);
    let hi = rows.ranges[..n].iter().map(|r| r.1).max().unwrap_or(0);
    let span = hi - lo;
    assert!(hi * hd <= keys.len() && hi * hd <= values.len(), "attention range past the cache");
    scratch.scores.resize(n * span, 0.0);
    scratch.keys.resize(LANES * hd, 0.0);
    let sc = _mm512_set1_ps(scale);
    let mut t = lo;
    while t < hi {
        let block = (hi - t).min(LANES);
        let kp = keys.as_ptr().add(t * hd);
        let wide = scratch.keys.as_mut_ptr();
        for c in (0..block * hd).step_by(LANES) {
            _mm512_storeu_ps(wide.add(c), _mm512_cvtph_ps(_mm256_loadu_si256(kp.add(c) as *const __m256i)));
        }
        for r in 0..n {
            let (a, b) = rows.ranges[r];
            if b <= t || a >= t + block {
                continue;
            }
            let (q, s) = (rows.q[r].as_ptr(), scratch.scores.as_mut_ptr().add(r * span + t - lo));
            if block == LANES {
                let mut acc = [_mm512_setzero_ps(); LANES];
                for c in (0..hd).step_by(LANES) {
                    let qv = _mm512_loadu_ps(q.add(c));
                    for (j, a) in acc.iter_mut().enumerate() {
                        *a = _mm512_fmadd_ps(_mm512_loadu_ps(wide.add(j * hd + c)), qv, *a);
                    }
                }
                _mm512_storeu_ps(s, _mm512_mul_ps(reduce_16x16(&acc), sc));
            } else {
                for j in 0..block {
                    *s.add(j) = chain(wide.add(j * hd), q, hd) * scale;
                }
            }
        }
        t += block;
    }
    for r in 0..n {
        let (a, b) = rows.ranges[r];
        softmax_in_place(&mut scratch.scores[r * span + a - lo..r * span + b - lo]);
    }
    let (s, vp) = (scratch.scores.as_ptr(), values.as_ptr());
    for c in (0..hd).step_by(4 * LANES) {
        let mut acc = [[_mm512_setzero_ps(); 4]; ROWS];
        for t in lo..hi {
            let row = vp.add(t * hd + c);
            let v: [__m512; 4] =
                std::array::from_fn(|j| _mm512_cvtph_ps(_mm256_loadu_si256(row.add(j * LANES) as *const __m256i)));
            for (r, acc) in acc.iter_mut().enumerate() {
                let (a, b) = rows.ranges[r];
                if r < n && t >= a && t < b {
                    let p = _mm512_set1_ps(*s.add(r * span + t - lo));
                    for j in 0..4 {
                        acc[j] = _mm512_fmadd_ps(p, v[j], acc[j]);
                    }
                }
            }
        }
        for (r, o) in out.iter_mut().enumerate().take(n) {
            for (j, a) in acc[r].iter().enumerate() {
                _mm512_storeu_ps(o.as_mut_ptr().add(c + j * LANES), *a);
            }
        }
    }
}

/// One slot of an f16 KV cache: keys and values `[kv_head][cap][head_dim]` (`cap`: the positions allocated per head).
pub struct F16Heads<'a> {
    pub keys: &'a [f16],
    pub values: &'a [f16],
    pub shape: AttnShape,
    pub cap: usize,
}

/// Attention of every row of `q` into `out` (`(n, n_heads·hd)`) over one slot's f16 K/V, row i seeing the cache
/// indices `range(i)`: `ROWS` consecutive rows of one head per task; `work` decides whether the tasks run on the
/// rayon pool. Only with AVX-512 (`isa::avx512`; asserted).
pub fn attend_blocks(
    heads: F16Heads,
    q: &[f32],
    out: &mut [f32],
    work: usize,
    range: impl Fn(usize) -> (usize, usize) + Sync,
) {
    let F16Heads { keys, values, shape: AttnShape { n_heads, n_kv_heads, head_dim: hd }, cap } = heads;
    assert!(isa::avx512(), "the blocked f16 attention needs AVX-512");
    assert!(
        hd.is_multiple_of(64) && keys.len() >= n_kv_heads * cap * hd && values.len() == keys.len(),
        "f16 attention shapes"
    );
    let (n, group) = (out.len() / (n_heads * hd), n_heads / n_kv_heads);
    let scale = 1.0 / (hd as f32).sqrt();
    let dst = OutRows(out.as_mut_ptr(), out.len());
    let task = |scratch: &mut Scratch, idx: usize| {
        let (r0, h) = ((idx / n_heads) * ROWS, idx % n_heads);
        let (nr, g) = ((n - r0).min(ROWS), h / group);
        let row = |r: usize| r0 + r.min(nr - 1);
        let rows = Rows {
            q: std::array::from_fn(|r| &q[(row(r) * n_heads + h) * hd..][..hd]),
            ranges: std::array::from_fn(|r| range(row(r))),
            n: nr,
        };
        // SAFETY: task (block, h) writes only rows r0..r0+nr of head h, pieces no other task touches.
        let mut outs: Vec<&mut [f32]> =
            (0..nr).map(|r| unsafe { dst.piece(((r0 + r) * n_heads + h) * hd, hd) }).collect();
        let (k, v) = (&keys[g * cap * hd..(g + 1) * cap * hd], &values[g * cap * hd..(g + 1) * cap * hd]);
        // SAFETY: the CPU has AVX-512 F (asserted above); hd is a multiple of 64 (asserted above); attend_rows checks
        // the ranges against `k` / `v`; q / out pieces are hd wide.
        unsafe { attend_rows(k, v, hd, scale, &rows, &mut outs, scratch) }
    };
    let tasks = n.div_ceil(ROWS) * n_heads;
    // attend_rows makes no rayon calls, so a thread never re-enters its scratch.
    let run = |i| SCRATCH.with_borrow_mut(|s| task(s, i));
    if work < ATTN_PARALLEL_MIN {
        (0..tasks).for_each(run);
    } else {
        (0..tasks).into_par_iter().for_each(run);
    }
}

thread_local! {
    /// Each thread's buffers, reused across calls (a 16-stream decode step makes a thousand small ones).
    static SCRATCH: std::cell::RefCell<Scratch> = Default::default();
}

/// `out` shared by the blocked attention's tasks, each of which writes its own disjoint pieces.
struct OutRows(*mut f32, usize);

// SAFETY: only `piece` reaches the pointer, and its callers hand each piece to one task.
unsafe impl Sync for OutRows {}

impl OutRows {
    /// # Safety
    /// No other live reference may overlap `at..at + len`.
    #[allow(clippy::mut_from_ref)]
    unsafe fn piece(&self, at: usize, len: usize) -> &mut [f32] {
        assert!(at + len <= self.1, "attention output piece out of range");
        std::slice::from_raw_parts_mut(self.0.add(at), len)
    }
}

/// `Σ k_i · q_i` over `hd` values (a multiple of 16): one 16-lane chain of multiply-adds, then `hsum` — the score of
/// one (row, key) pair in every path.
///
/// # Safety
/// As `hsum`; `k` and `q` must hold `hd` values.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn chain(k: *const f32, q: *const f32, hd: usize) -> f32 {
    let mut acc = _mm512_setzero_ps();
    for c in (0..hd).step_by(LANES) {
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(k.add(c)), _mm512_loadu_ps(q.add(c)), acc);
    }
    hsum(acc)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pseudo(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 2001) as f32 / 1000.0) - 1.0)
            .collect()
    }

    #[test]
    fn transposing_tree_is_sixteen_hsums_bit_for_bit() {
        if !isa::avx512() {
            return; // the kernel runs only with AVX-512
        }
        let x = pseudo(256, 3);
        unsafe {
            let a: [__m512; LANES] = std::array::from_fn(|j| _mm512_loadu_ps(x.as_ptr().add(j * LANES)));
            let mut got = [0f32; LANES];
            _mm512_storeu_ps(got.as_mut_ptr(), reduce_16x16(&a));
            for j in 0..LANES {
                assert_eq!(got[j].to_bits(), hsum(a[j]).to_bits(), "lane {j}");
                let pairwise = |v: &[f32]| -> f32 {
                    let b: Vec<f32> = (0..8).map(|i| v[i] + v[i + 8]).collect();
                    let c: Vec<f32> = (0..4).map(|i| b[i] + b[i + 4]).collect();
                    (c[0] + c[2]) + (c[1] + c[3])
                };
                assert_eq!(got[j].to_bits(), pairwise(&x[j * LANES..(j + 1) * LANES]).to_bits(), "lane {j} order");
            }
        }
    }

    /// softmax(q·Kᵀ/√d)·V in f64 over the widened f16 keys and values.
    fn reference(k: &[f16], v: &[f16], q: &[f32], hd: usize, (a, b): (usize, usize)) -> Vec<f64> {
        let s: Vec<f64> = (a..b)
            .map(|t| (0..hd).map(|d| q[d] as f64 * k[t * hd + d].to_f64()).sum::<f64>() / (hd as f64).sqrt())
            .collect();
        let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
        (0..hd).map(|d| (a..b).zip(&s).map(|(t, x)| (x - m).exp() / z * v[t * hd + d].to_f64()).sum()).collect()
    }

    #[test]
    fn rows_match_f64_and_do_not_depend_on_their_block_mates() {
        if !isa::avx512() {
            return; // the kernel runs only with AVX-512
        }
        for hd in [64, 128] {
            let n_keys = 53; // three full 16-key blocks and a tail of 5
            let k: Vec<f16> = pseudo(n_keys * hd, 1).iter().map(|&x| f16::from_f32(2.0 * x)).collect();
            let v: Vec<f16> = pseudo(n_keys * hd, 2).iter().map(|&x| f16::from_f32(x)).collect();
            let q = pseudo(ROWS * hd, 5);
            let qs: [&[f32]; ROWS] = std::array::from_fn(|r| &q[r * hd..(r + 1) * hd]);
            // Causal rows ending at 48..53, plus one windowed row and one that starts mid-block.
            let ranges = [(0, 48), (0, 49), (3, 50), (17, 51), (0, 52), (40, 53)];
            let scale = 1.0 / (hd as f32).sqrt();
            let mut scratch = Scratch::default();
            let mut together = vec![vec![0f32; hd]; ROWS];
            unsafe {
                let mut outs: Vec<&mut [f32]> = together.iter_mut().map(|o| o.as_mut_slice()).collect();
                attend_rows(&k, &v, hd, scale, &Rows { q: qs, ranges, n: ROWS }, &mut outs, &mut scratch);
            }
            for r in 0..ROWS {
                let want = reference(&k, &v, qs[r], hd, ranges[r]);
                let err = together[r].iter().zip(&want).map(|(a, b)| (*a as f64 - b).abs()).fold(0.0, f64::max);
                assert!(err < 1e-5, "hd {hd} row {r}: {err}");
                // The same row alone (and in a block of two, first or second) gives the same bits.
                for (mates, at) in [(vec![r], 0), (vec![r, (r + 1) % ROWS], 0), (vec![(r + 2) % ROWS, r], 1)] {
                    let mut alone = vec![vec![0f32; hd]; mates.len()];
                    let sub = Rows {
                        q: std::array::from_fn(|i| qs[mates.get(i).copied().unwrap_or(0)]),
                        ranges: std::array::from_fn(|i| ranges[mates.get(i).copied().unwrap_or(0)]),
                        n: mates.len(),
                    };
                    unsafe {
                        let mut outs: Vec<&mut [f32]> = alone.iter_mut().map(|o| o.as_mut_slice()).collect();
                        attend_rows(&k, &v, hd, scale, &sub, &mut outs, &mut scratch);
                    }
                    assert!(
                        alone[at].iter().zip(&together[r]).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "hd {hd} row {r} with {mates:?}"
                    );
                }
            }
        }
    }
}
