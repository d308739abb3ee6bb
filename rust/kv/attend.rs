//! Attention over one slot of the KV cache: each query row attends to the stored positions its layout lets it see,
//! reading keys and values in their stored format (`elem.rs`: dot products and weighted sums on the codes). f16 rows
//! that see contiguous ranges go through the blocked AVX-512 kernel (`kernels::attn_f16`); every other row through
//! `attend_one`, one (row, head) task at a time.

use rayon::prelude::*;

use super::elem::{hadamard, KvElem};
#[cfg(target_arch = "x86_64")]
use crate::kernels::attn_f16::{attend_blocks, F16Heads};
#[cfg(target_arch = "x86_64")]
use crate::kernels::isa;
use crate::kernels::simd::softmax_in_place;
use crate::kernels::AttnShape;
use crate::limits::ATTN_PARALLEL_MIN;

/// Where each new row is stored and what it may attend to (see `KvCache::write_rows_and_attend`).
pub struct RowLayout<'a> {
    pub store: &'a [usize],
    pub prefix: &'a [usize],
    pub extra: &'a [Vec<usize>],
    /// Each row's RoPE position (where its window starts from).
    pub pos: &'a [usize],
    /// Rows whose K/V here is a copy of another slot's at the row's index — (row, source slot) — made before any
    /// row attends: adaptive depth's rows that stopped looping (`cache/fill.rs`).
    pub fills: &'a [(usize, usize)],
}

impl RowLayout<'_> {
    /// The first position row `i` sees under a sliding window of `window` (0: no window).
    #[inline]
    pub(super) fn visible_from(&self, i: usize, window: usize) -> usize {
        if window > 0 {
            (self.pos[i] + 1).saturating_sub(window)
        } else {
            0
        }
    }
}

/// What one call knows of its cache: the attention shape, the positions a slot may hold (the sequence's capacity),
/// the window, and whether rows are Hadamard-rotated ("int4-h").
#[derive(Clone, Copy)]
pub(super) struct Ctx {
    pub shape: AttnShape,
    pub cap: usize,
    pub window: usize,
    pub rotate: bool,
}

/// One slot's stored rows, `[kv_head][stride][head_dim / PACK]`, and their metadata, `[kv_head][stride]`; index
/// `t` holds position `base + t`.
pub(super) struct SlotView<'a, T: KvElem> {
    pub keys: &'a [T],
    pub values: &'a [T],
    pub k_meta: &'a [T::Meta],
    pub v_meta: &'a [T::Meta],
    pub base: usize,
    pub stride: usize,
}

/// Attend the query rows `q` (`(n, n_heads·head_dim)`, laid out as `layout`) over `slot` into `out`.
pub(super) fn attend<T: KvElem>(slot: SlotView<T>, ctx: Ctx, layout: &RowLayout, q: &[f32], out: &mut [f32]) {
    let Ctx { shape: AttnShape { n_heads, n_kv_heads, head_dim: hd }, window, rotate, .. } = ctx;
    let w = hd / T::PACK;
    let group = n_heads / n_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let SlotView { keys: ks, values: vs, k_meta: kms, v_meta: vms, base, stride: cap } = slot;
    let work: usize =
        layout.prefix.iter().map(|&p| p.min(if window > 0 { window } else { p })).sum::<usize>() * n_heads * hd;
    #[cfg(target_arch = "x86_64")]
    if let (true, Some(keys), Some(values)) =
        (isa::avx512() && layout.extra.is_empty() && hd.is_multiple_of(64), T::as_f16(ks), T::as_f16(vs))
    {
        let heads = F16Heads { keys, values, shape: ctx.shape, cap };
        attend_blocks(heads, q, out, work, |i| {
            (layout.visible_from(i, window).max(base) - base, layout.prefix[i] - base)
        });
        return;
    }
    const NONE: &[usize] = &[];
    // One task per (row, head); each writes its own head_dim-wide piece of `out`.
    let task = |(idx, o): (usize, &mut [f32])| {
        let (i, h) = (idx / n_heads, idx % n_heads);
        let g = h / group;
        let head = HeadView {
            keys: &ks[g * cap * w..(g + 1) * cap * w],
            values: &vs[g * cap * w..(g + 1) * cap * w],
            k_meta: &kms[g * cap..(g + 1) * cap],
            v_meta: &vms[g * cap..(g + 1) * cap],
        };
        let from = layout.visible_from(i, window).max(base);
        let extra = layout.extra.get(i).map_or(NONE, Vec::as_slice);
        let visible = (from..layout.prefix[i]).chain(extra.iter().copied()).map(|t| t - base);
        let q_row = &q[idx * hd..(idx + 1) * hd];
        if rotate {
            let mut qr = q_row.to_vec();
            hadamard(&mut qr);
            attend_one(&qr, &head, visible, hd, scale, o);
            hadamard(o);
        } else {
            attend_one(q_row, &head, visible, hd, scale, o);
        }
    };
    if work < ATTN_PARALLEL_MIN {
        out.chunks_mut(hd).enumerate().for_each(task);
    } else {
        out.par_chunks_mut(hd).enumerate().for_each(task);
    }
}

/// One KV head's stored keys and values, `[index][head_dim / PACK]`, and their per-index metadata.
struct HeadView<'a, T: KvElem> {
    keys: &'a [T],
    values: &'a [T],
    k_meta: &'a [T::Meta],
    v_meta: &'a [T::Meta],
}

/// softmax(q·Kᵀ·scale)·V for one query row over the stored indices `visible`, accumulated in f32.
fn attend_one<T: KvElem>(
    q: &[f32],
    head: &HeadView<T>,
    visible: impl Iterator<Item = usize> + Clone,
    hd: usize,
    scale: f32,
    out: &mut [f32],
) {
    let w = hd / T::PACK;
    let q_sum: f32 = q.iter().sum();
    let mut scores: Vec<f32> =
        visible.clone().map(|t| T::dot(&head.keys[t * w..(t + 1) * w], head.k_meta[t], q, q_sum) * scale).collect();
    softmax_in_place(&mut scores);
    T::weighted_sum(head.values, head.v_meta, w, visible, &scores, out);
}
