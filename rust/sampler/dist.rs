//! The distribution a token is drawn from, built from processed logits without sorting the vocabulary.
//!
//! With neither top-k nor top-p, every token keeps its weight `exp((l − max) / T)`: one vector pass fills a dense
//! array, with sums of 1024-id blocks so that a draw walks ~50 block sums and then one block. Top-p alone can be
//! drawn from those weights by rejection (`draw_nucleus`), with no cut to find. Otherwise only the head of the
//! descending order matters, and the head is found by threshold: the ids with `l ≥ threshold` are gathered (a
//! vector compare). For top-k the threshold comes from counting passes over group maxima (`top_k_threshold`); for
//! top-p it starts at max − 8·T (weights down to e⁻⁸ of the largest) and widens 4× at a time until the gathered set
//! holds top-p of the total mass, which it always does once the threshold reaches the smallest logit. Every id at
//! or above the threshold is gathered, ties included, so the gathered set is always a prefix of the full descending
//! order: top-k selects and sorts its k ids, top-p finds its cut with a histogram (`nucleus`), and either way the
//! kept set is the one a full sort would give. The gathered weights are f64 (the cut compares sums); the mass
//! outside them (top-p's denominator) comes from one masked pass.

use crate::kernels::logits::{
    argmax, buckets, count_at_least, exp_f64, exp_sum_below, exp_weights, group_maxima, ids_at_least, mass_ahead,
    max_value, BLOCK,
};

/// A distribution over token ids; weights are unnormalised, summing to `total`.
#[derive(Debug, Clone)]
pub enum Dist {
    /// One token (greedy, or nothing else left to draw).
    Point(u32),
    /// A weight for every id (0 where it cannot be drawn); `blocks[b]` sums ids `b·BLOCK .. (b+1)·BLOCK`.
    Dense { w: Vec<f32>, blocks: Vec<f64>, total: f64 },
    /// The kept ids in descending probability (ties: lower id first) with their weights.
    Sparse { items: Vec<(u32, f64)>, total: f64 },
}

impl Dist {
    /// The normalised probability of `id`.
    pub fn prob(&self, id: u32) -> f64 {
        match self {
            Dist::Point(t) => f64::from(u8::from(*t == id)),
            Dist::Dense { w, total, .. } => w.get(id as usize).map_or(0.0, |&x| x as f64 / total),
            Dist::Sparse { items, total } => items.iter().find(|e| e.0 == id).map_or(0.0, |e| e.1 / total),
        }
    }

    /// The token at `u ∈ [0, 1)` of the cumulative distribution (ids in the order the variant keeps them).
    pub fn draw(&self, u: f64) -> u32 {
        match self {
            Dist::Point(t) => *t,
            Dist::Sparse { items, total } => {
                let mut left = u * total;
                for &(id, p) in items {
                    if left < p {
                        return id;
                    }
                    left -= p;
                }
                items.iter().rev().find(|e| e.1 > 0.0).map_or(0, |e| e.0)
            }
            Dist::Dense { w, blocks, total } => draw_dense(w, blocks, *total, u),
        }
    }

    /// `max(0, p − q)` over p's support, normalised weights (None when it is empty: p ≤ q everywhere).
    pub fn residual(p: &Dist, q: &Dist) -> Option<Dist> {
        let items: Vec<(u32, f64)> = match p {
            Dist::Point(t) => vec![(*t, 1.0)],
            Dist::Sparse { items, total } => items.iter().map(|&(id, x)| (id, x / total)).collect(),
            Dist::Dense { w, total, .. } => {
                w.iter().enumerate().filter(|e| *e.1 > 0.0).map(|(id, &x)| (id as u32, x as f64 / total)).collect()
            }
        };
        let q_of = q.lookup();
        let items: Vec<(u32, f64)> =
            items.into_iter().map(|(id, px)| (id, px - q_of(id))).filter(|e| e.1 > 0.0).collect();
        let total = items.iter().map(|e| e.1).sum();
        (!items.is_empty()).then_some(Dist::Sparse { items, total })
    }

    /// `prob` as a function, with a hash map over a sparse support (looked up once per id of another support).
    fn lookup(&self) -> Box<dyn Fn(u32) -> f64 + '_> {
        match self {
            Dist::Sparse { items, total } => {
                let map: std::collections::HashMap<u32, f64> = items.iter().map(|&(id, x)| (id, x / total)).collect();
                Box::new(move |id| map.get(&id).copied().unwrap_or(0.0))
            }
            _ => Box::new(|id| self.prob(id)),
        }
    }
}

/// The id at `u ∈ [0, 1)` of the cumulative dense weights `w` (block sums `blocks`, total `total`): ~50 block sums
/// walked, then one block.
fn draw_dense(w: &[f32], blocks: &[f64], total: f64, u: f64) -> u32 {
    let mut left = u * total;
    for (b, &mass) in blocks.iter().enumerate() {
        if left >= mass {
            left -= mass;
            continue;
        }
        for (i, &x) in w[b * BLOCK..].iter().take(BLOCK).enumerate() {
            if left < x as f64 {
                return (b * BLOCK + i) as u32;
            }
            left -= x as f64;
        }
    }
    // Rounding left `left` just past the last weight: the last id that can be drawn.
    w.iter().rposition(|&x| x > 0.0).unwrap_or(0) as u32
}

/// Reusable buffers of `build`: the dense weights, and the gathered ids with their logits and weights.
#[derive(Debug, Default)]
pub struct Scratch {
    weights: Vec<f32>,
    blocks: Vec<f64>,
    /// More dense buffers, given back by distributions that were kept a while (a speculative round's drafts).
    spare: Vec<(Vec<f32>, Vec<f64>)>,
    ids: Vec<u32>,
    values: Vec<f32>,
    head_weights: Vec<f64>,
    bins: Vec<u8>,
    maxima: Vec<f32>,
}

impl Scratch {
    /// Dense buffers for a distribution that leaves with them.
    fn take_dense(&mut self) -> (Vec<f32>, Vec<f64>) {
        if self.weights.capacity() == 0 {
            return self.spare.pop().unwrap_or_default();
        }
        (std::mem::take(&mut self.weights), std::mem::take(&mut self.blocks))
    }

    /// Keep a dense distribution's buffers for the next one (a speculative round holds a few at once).
    pub fn give_back(&mut self, dist: Dist) {
        let Dist::Dense { w, blocks, .. } = dist else { return };
        if self.weights.capacity() == 0 {
            (self.weights, self.blocks) = (w, blocks);
        } else if self.spare.len() < MAX_SPARE {
            self.spare.push((w, blocks));
        }
    }
}

/// Spare dense buffers kept: a chain round holds one per draft and one per verified row.
const MAX_SPARE: usize = 16;

/// The distribution of `logits` at temperature `t` (> 0) with `top_k` (0 = all) and `top_p`: the tokens with the
/// largest logits (ties: lower id first), then the smallest set of them whose mass reaches `top_p`.
pub fn build(logits: &[f32], t: f32, top_k: usize, top_p: f32, scratch: &mut Scratch) -> Dist {
    let max = max_value(logits);
    if max == f32::NEG_INFINITY {
        return Dist::Point(argmax(logits));
    }
    let inv_t = 1.0 / t;
    let k = if top_k > 0 && top_k < logits.len() { top_k } else { 0 };
    // A temperature so small that 1/T overflows f32 (a subnormal T) takes the f64 path below: there the weights
    // are 1 for the maxima and 0 for the rest, where the f32 pass would compute 0 · ∞.
    if k == 0 && top_p >= 1.0 && inv_t.is_finite() {
        let (mut w, mut blocks) = scratch.take_dense();
        let total = exp_weights(logits, max, inv_t, &mut w, &mut blocks);
        return Dist::Dense { w, blocks, total };
    }
    // The threshold widens by 4x in distance from the max; the smallest finite logit (found only if the first
    // threshold is not enough) bounds it, and a threshold at that bound gathers every finite logit.
    let (mut delta, mut lowest) = ((8.0 * t).max(1e-3), None);
    let (mut threshold, mut everything) =
        if k > 0 { top_k_threshold(logits, max, k, t, &mut scratch.maxima) } else { (max - delta, false) };
    let mut widen = |threshold: &mut f32, everything: &mut bool| {
        let lo = *lowest.get_or_insert_with(|| logits.iter().copied().filter(|&l| l >= f32::MIN).fold(max, f32::min));
        delta *= 4.0;
        (*threshold, *everything) = if max - delta <= lo { (lo, true) } else { (max - delta, false) };
    };
    let order = |&a: &u32, &b: &u32| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b));
    loop {
        let Scratch { ids, values, head_weights, bins, .. } = &mut *scratch;
        ids_at_least(logits, threshold, ids);
        if ids.len() < k && !everything {
            widen(&mut threshold, &mut everything);
            continue;
        }
        if k > 0 && ids.len() > k {
            ids.select_nth_unstable_by(k - 1, order);
            ids.truncate(k);
            ids.sort_unstable_by(order);
        }
        values.clear();
        values.extend(ids.iter().map(|&i| logits[i as usize]));
        exp_f64(values, max, 1.0 / t as f64, head_weights);
        let head: f64 = head_weights.iter().sum();
        if top_p >= 1.0 {
            return Dist::Sparse {
                items: ids.iter().copied().zip(head_weights.iter().copied()).collect(),
                total: head,
            };
        }
        // The denominator of top-p: the top-k set's own mass, or the whole vocabulary's.
        let rest = if k > 0 || everything { 0.0 } else { exp_sum_below(logits, max, inv_t, threshold) };
        match nucleus(ids, values, head_weights, top_p as f64 * (head + rest), bins) {
            Some(items) => {
                let total = items.iter().map(|e| e.1).sum();
                return Dist::Sparse { items, total };
            }
            None if !(everything || k > 0) => widen(&mut threshold, &mut everything),
            // Rounding kept the mass a hair under the target: the whole set is the nucleus.
            None => {
                return Dist::Sparse {
                    items: ids.iter().copied().zip(head_weights.iter().copied()).collect(),
                    total: head,
                }
            }
        }
    }
}

/// A threshold with at least `k` logits at or above it and not many more: `(f32::MIN, true)` — every finite logit —
/// when no more than k are finite. The search runs over the maxima of groups of 16 logits (`group_maxima`, one
/// vector pass), 16 times fewer values: k maxima at or above a threshold mean at least k logits there and at most
/// 16k, and each step of the search is a pass over a sixteenth of the vocabulary. (With fewer than k finite maxima
/// it searches the logits.)
fn top_k_threshold(logits: &[f32], max: f32, k: usize, t: f32, maxima: &mut Vec<f32>) -> (f32, bool) {
    if count_at_least(logits, f32::MIN) <= k {
        return (f32::MIN, true);
    }
    group_maxima(logits, maxima);
    let values = if count_at_least(maxima, f32::MIN) >= k { &maxima[..] } else { logits };
    (narrow(values, max, k, t), false)
}

/// A threshold with at least `k` of `values` at or above it (at least k are finite) and, where ties allow, at most
/// `NARROW_SLACK` more: counting passes (`count_at_least`, no ids stored) widen the distance from the max 4x at a
/// time from the temperature until k values are in, then halve the gap between the last two thresholds.
fn narrow(values: &[f32], max: f32, k: usize, t: f32) -> f32 {
    let count = |threshold: f32| count_at_least(values, threshold);
    let (mut delta, mut above) = (t.max(1e-3), max);
    let mut below = (max - delta).max(f32::MIN);
    let mut n = count(below);
    while n < k {
        (above, delta) = (below, delta * 4.0);
        below = (max - delta).max(f32::MIN);
        n = count(below);
    }
    for _ in 0..32 {
        let mid = below + (above - below) / 2.0;
        if n <= k + NARROW_SLACK || mid <= below || mid >= above {
            break;
        }
        match count(mid) {
            c if c >= k => (below, n) = (mid, c),
            _ => above = mid,
        }
    }
    below
}

/// Values past k at which `narrow` stops.
const NARROW_SLACK: usize = 16;

/// The smallest top-p that `draw_nucleus` serves: a draw lands in the nucleus with probability ≥ top-p, so below
/// this more than four draws would be expected and `build` finds the cut instead.
pub const REJECTION_TOP_P: f32 = 0.25;

/// Draws `draw_nucleus` makes before it gives up (at top-p ≥ 0.25 it does so less often than once in 100).
const NUCLEUS_TRIES: usize = 16;

/// A token from the top-p nucleus at temperature `t`, by rejection: draw from every token (the dense weights of
/// `build`), keep the draw if the mass ahead of it in descending order (`mass_ahead`, one vector pass) is below
/// top-p of the total — that is, if it lies in the nucleus — and draw again if not. An accepted draw has
/// probability p(x) / p(nucleus): the nucleus distribution exactly, with no cut to find. None after
/// `NUCLEUS_TRIES` misses (or where the dense pass does not apply); the caller then draws from `build`'s
/// distribution, and the mixture of the two is still exact.
pub fn draw_nucleus(
    logits: &[f32],
    t: f32,
    top_p: f32,
    scratch: &mut Scratch,
    mut uniform: impl FnMut() -> f64,
) -> Option<u32> {
    let (max, inv_t) = (max_value(logits), 1.0 / t);
    if max == f32::NEG_INFINITY || !inv_t.is_finite() {
        return None;
    }
    let Scratch { weights: w, blocks, .. } = scratch;
    let total = exp_weights(logits, max, inv_t, w, blocks);
    let target = top_p as f64 * total;
    let mut draws = (0..NUCLEUS_TRIES).map(|_| draw_dense(w, blocks, total, uniform()));
    draws.find(|&id| mass_ahead(logits, w, id as usize) < target)
}

/// Buckets of `nucleus`' histogram.
const BUCKETS: usize = 256; // the range of a u8 bin

/// The smallest set, in descending probability (ties: lower id first), of the gathered `ids` (with their logits
/// `values` and weights `w`) whose weights sum to `target` or more; None if all of them fall short. Not a sort: a
/// histogram of the mass over 256 equal ranges of logit value finds the range where the running mass crosses the
/// target — every id in a range above it is kept — and only that range's ids are sorted and walked. A bucket is a
/// monotone function of the logit, so ties share one and the kept set is the one a full sort would give. The kept
/// ids come in a fixed order: the ranges above in id order, then the sorted part of the crossing range.
fn nucleus(ids: &[u32], values: &[f32], w: &[f64], target: f64, bins: &mut Vec<u8>) -> Option<Vec<(u32, f64)>> {
    let hi = max_value(values);
    let lo = values.iter().copied().fold(hi, f32::min);
    let scale = if hi > lo { (BUCKETS - 1) as f32 / (hi - lo) } else { 0.0 };
    buckets(values, hi, scale, bins);
    let mut mass = [0f64; BUCKETS];
    bins.iter().zip(w).for_each(|(&b, &x)| mass[b as usize] += x);
    let mut above = 0.0;
    let crossing = (0..BUCKETS).find(|&b| {
        let reached = above + mass[b] >= target;
        if !reached {
            above += mass[b];
        }
        reached
    })?;
    let mut kept = Vec::new();
    let mut edge = Vec::new();
    for (((&id, &v), &x), &b) in ids.iter().zip(values).zip(w).zip(bins.iter()) {
        match (b as usize).cmp(&crossing) {
            std::cmp::Ordering::Less => kept.push((id, x)),
            std::cmp::Ordering::Equal => edge.push((id, v, x)),
            std::cmp::Ordering::Greater => {}
        }
    }
    edge.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    for (id, _, x) in edge {
        kept.push((id, x));
        above += x;
        if above >= target {
            break;
        }
    }
    Some(kept)
}
