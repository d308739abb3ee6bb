//! The KV cache: one slot per (prelude layer) and per (loop, block layer), each preallocated for the sequence's
//! capacity and written in place. Each slot keeps its own length, because a draft pass fills only the first
//! loops' slots and verification fills the rest later; `truncate` rolls every slot back at once.
//!
//! Element type: f32 for models whose weights are F32, f16 for every other model (the reference's "fp16" mode).
//! Slot layout is `[kv_head][position][head_dim]`, so one head's keys are contiguous for the attention dot products.

use half::f16;
use rayon::prelude::*;

use crate::error::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvKind {
    F32,
    F16,
}

impl KvKind {
    pub fn bytes_per_value(self) -> usize {
        match self {
            KvKind::F32 => 4,
            KvKind::F16 => 2,
        }
    }
}

pub trait KvElem: Copy + Send + Sync + Default + 'static {
    fn from_f32(x: f32) -> Self;
    fn to_f32(self) -> f32;
}

impl KvElem for f32 {
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl KvElem for f16 {
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

struct Slot<T> {
    k: Vec<T>,
    v: Vec<T>,
    len: usize,
}

enum SlotBuf {
    F32(Slot<f32>),
    F16(Slot<f16>),
}

/// Shape of attention for one call: `n_heads` query heads share `n_kv_heads` K/V heads (GQA).
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

pub struct KvCache {
    kind: KvKind,
    shape: AttnShape,
    capacity: usize,
    slots: Vec<Option<SlotBuf>>,
}

impl KvCache {
    pub fn new(kind: KvKind, shape: AttnShape, capacity: usize, n_slots: usize) -> Self {
        Self { kind, shape, capacity, slots: (0..n_slots).map(|_| None).collect() }
    }

    pub fn kind(&self) -> KvKind {
        self.kind
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Positions held by `slot` (0 if never written).
    pub fn slot_len(&self, slot: usize) -> usize {
        match self.slots.get(slot) {
            Some(Some(SlotBuf::F32(s))) => s.len,
            Some(Some(SlotBuf::F16(s))) => s.len,
            _ => 0,
        }
    }

    /// Roll every slot back to at most `len` positions. Nothing is freed; later writes overwrite in place.
    pub fn truncate(&mut self, len: usize) {
        for slot in self.slots.iter_mut().flatten() {
            match slot {
                SlotBuf::F32(s) => s.len = s.len.min(len),
                SlotBuf::F16(s) => s.len = s.len.min(len),
            }
        }
    }

    /// Bytes of K/V holding live positions (what the metrics report).
    pub fn bytes_in_use(&self) -> usize {
        let per_pos = 2 * self.shape.n_kv_heads * self.shape.head_dim * self.kind.bytes_per_value();
        (0..self.slots.len()).map(|s| self.slot_len(s) * per_pos).sum()
    }

    /// Write K/V rows for positions `pos..pos+n` into `slot`, then attend the `n` query rows causally over the slot.
    /// `k`, `v`: `(n, n_kv_heads*head_dim)`; `q`, `out`: `(n, n_heads*head_dim)`, row i at position `pos + i`.
    pub fn write_and_attend(&mut self, slot: usize, pos: usize, k: &[f32], v: &[f32], q: &[f32], out: &mut [f32]) -> Result<()> {
        let n = k.len() / (self.shape.n_kv_heads * self.shape.head_dim).max(1);
        let store: Vec<usize> = (pos..pos + n).collect();
        let visible: Vec<usize> = (pos + 1..=pos + n).collect();
        self.write_rows_and_attend(slot, &RowLayout { store: &store, prefix: &visible, extra: &[] }, k, v, q, out)
    }

    /// The general form: row i is stored at index `layout.store[i]` and attends to indices `0..layout.prefix[i]`
    /// plus `layout.extra[i]` (tree verification: a node sees its ancestors and itself, not its siblings).
    pub fn write_rows_and_attend(&mut self, slot: usize, layout: &RowLayout, k: &[f32], v: &[f32], q: &[f32], out: &mut [f32]) -> Result<()> {
        let AttnShape { n_heads, n_kv_heads, head_dim } = self.shape;
        let kvw = n_kv_heads * head_dim;
        let n = layout.store.len();
        if n == 0 || k.len() != n * kvw || v.len() != k.len() || q.len() != n * n_heads * head_dim || out.len() != q.len()
            || layout.prefix.len() != n || !(layout.extra.is_empty() || layout.extra.len() == n)
        {
            return Err(Error::Internal(format!("attention: bad row shapes for slot {slot}")));
        }
        let (lo, hi) = (layout.store.iter().min().copied().unwrap_or(0), layout.store.iter().max().copied().unwrap_or(0));
        if hi >= self.capacity {
            return Err(Error::ContextLength { needed: hi + 1, limit: self.capacity });
        }
        let have = self.slot_len(slot);
        if lo > have {
            return Err(Error::Internal(format!("slot {slot} holds {have} positions, cannot write at {lo}")));
        }
        let (cap, shape) = (self.capacity, self.shape);
        let size = cap * kvw;
        let entry = self.slots.get_mut(slot).ok_or_else(|| Error::Internal(format!("no KV slot {slot}")))?;
        let buf = entry.get_or_insert_with(|| match self.kind {
            KvKind::F32 => SlotBuf::F32(Slot { k: vec![0.0; size], v: vec![0.0; size], len: 0 }),
            KvKind::F16 => SlotBuf::F16(Slot { k: vec![f16::ZERO; size], v: vec![f16::ZERO; size], len: 0 }),
        });
        match buf {
            SlotBuf::F32(s) => s.write_and_attend(shape, cap, layout, k, v, q, out),
            SlotBuf::F16(s) => s.write_and_attend(shape, cap, layout, k, v, q, out),
        }
        Ok(())
    }

    /// Move the K/V stored at index `from` to index `to` in every slot that holds it (tree compaction).
    pub fn move_position(&mut self, from: usize, to: usize) {
        let width = self.shape.head_dim;
        let (heads, cap) = (self.shape.n_kv_heads, self.capacity);
        for slot in self.slots.iter_mut().flatten() {
            match slot {
                SlotBuf::F32(s) => s.move_position(heads, cap, width, from, to),
                SlotBuf::F16(s) => s.move_position(heads, cap, width, from, to),
            }
        }
    }
}

/// Where each new row is stored and what it may attend to (see `KvCache::write_rows_and_attend`).
pub struct RowLayout<'a> {
    pub store: &'a [usize],
    pub prefix: &'a [usize],
    pub extra: &'a [Vec<usize>],
}

impl<T: KvElem> Slot<T> {
    #[allow(clippy::too_many_arguments)]
    fn write_and_attend(&mut self, shape: AttnShape, cap: usize, layout: &RowLayout, k: &[f32], v: &[f32], q: &[f32], out: &mut [f32]) {
        let AttnShape { n_heads, n_kv_heads, head_dim: hd } = shape;
        for (i, &at) in layout.store.iter().enumerate() {
            for g in 0..n_kv_heads {
                let src = (i * n_kv_heads + g) * hd;
                let dst = (g * cap + at) * hd;
                for d in 0..hd {
                    self.k[dst + d] = T::from_f32(k[src + d]);
                    self.v[dst + d] = T::from_f32(v[src + d]);
                }
            }
        }
        self.len = layout.store.iter().max().map_or(self.len, |m| m + 1);
        let group = n_heads / n_kv_heads;
        let scale = 1.0 / (hd as f32).sqrt();
        let (ks, vs) = (&self.k, &self.v);
        const NONE: &[usize] = &[];
        // One task per (row, head); each writes its own head_dim-wide piece of `out`.
        let task = |(idx, o): (usize, &mut [f32])| {
            let (i, h) = (idx / n_heads, idx % n_heads);
            let base = (h / group) * cap * hd;
            let extra = layout.extra.get(i).map_or(NONE, Vec::as_slice);
            let head = (&ks[base..base + cap * hd], &vs[base..base + cap * hd]);
            attend_one(&q[idx * hd..(idx + 1) * hd], head, layout.prefix[i], extra, hd, scale, o);
        };
        let work: usize = layout.prefix.iter().sum::<usize>() * n_heads * hd;
        if work < 1 << 16 {
            out.chunks_mut(hd).enumerate().for_each(task);
        } else {
            out.par_chunks_mut(hd).enumerate().for_each(task);
        }
    }

    fn move_position(&mut self, heads: usize, cap: usize, hd: usize, from: usize, to: usize) {
        if from >= self.len {
            return;
        }
        for g in 0..heads {
            let (src, dst) = ((g * cap + from) * hd, (g * cap + to) * hd);
            self.k.copy_within(src..src + hd, dst);
            self.v.copy_within(src..src + hd, dst);
        }
    }
}

/// softmax(q·Kᵀ·scale)·V for one query row over key indices `0..prefix` and `extra`, accumulated in f32.
/// `head` holds one KV head's keys and values, `[position][head_dim]`.
fn attend_one<T: KvElem>(q: &[f32], head: (&[T], &[T]), prefix: usize, extra: &[usize], hd: usize, scale: f32, out: &mut [f32]) {
    let (keys, values) = head;
    let dot = |t: usize| keys[t * hd..(t + 1) * hd].iter().zip(q).map(|(a, b)| a.to_f32() * b).sum::<f32>() * scale;
    let index = |j: usize| if j < prefix { j } else { extra[j - prefix] };
    let mut scores: Vec<f32> = (0..prefix + extra.len()).map(|j| dot(index(j))).collect();
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    out.fill(0.0);
    for (j, p) in scores.iter().enumerate() {
        let w = p / sum;
        let t = index(j);
        for (o, x) in out.iter_mut().zip(&values[t * hd..(t + 1) * hd]) {
            *o += w * x.to_f32();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pseudo(n: usize, seed: u32) -> Vec<f32> {
        (0..n).map(|i| (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 1000) as f32 / 500.0) - 1.0).collect()
    }

    /// Plain causal attention over all rows at once, for comparison.
    fn naive(shape: AttnShape, q: &[f32], k: &[f32], v: &[f32]) -> Vec<f32> {
        let AttnShape { n_heads, n_kv_heads, head_dim: hd } = shape;
        let n = q.len() / (n_heads * hd);
        let mut out = vec![0.0; q.len()];
        for i in 0..n {
            for h in 0..n_heads {
                let g = h / (n_heads / n_kv_heads);
                let qv = &q[(i * n_heads + h) * hd..][..hd];
                let s: Vec<f32> = (0..=i).map(|t| (0..hd).map(|d| qv[d] * k[(t * n_kv_heads + g) * hd + d]).sum::<f32>() / (hd as f32).sqrt()).collect();
                let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let z: f32 = s.iter().map(|x| (x - m).exp()).sum();
                for t in 0..=i {
                    for d in 0..hd {
                        out[(i * n_heads + h) * hd + d] += (s[t] - m).exp() / z * v[(t * n_kv_heads + g) * hd + d];
                    }
                }
            }
        }
        out
    }

    #[test]
    fn prefill_decode_and_rollback_match_naive_attention() {
        let shape = AttnShape { n_heads: 4, n_kv_heads: 2, head_dim: 8 };
        let (n, qw, kw) = (6, 32, 16);
        let (q, k, v) = (pseudo(n * qw, 1), pseudo(n * kw, 2), pseudo(n * kw, 3));
        let want = naive(shape, &q, &k, &v);
        let mut cache = KvCache::new(KvKind::F32, shape, 16, 1);
        let mut out = vec![0.0; n * qw];
        cache.write_and_attend(0, 0, &k, &v, &q, &mut out).unwrap();
        assert!(out.iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-5));
        // Roll back to 2 positions and decode the rest one by one: same rows.
        cache.truncate(2);
        assert_eq!(cache.slot_len(0), 2);
        for i in 2..n {
            let mut o = vec![0.0; qw];
            cache.write_and_attend(0, i, &k[i * kw..][..kw], &v[i * kw..][..kw], &q[i * qw..][..qw], &mut o).unwrap();
            assert!(o.iter().zip(&want[i * qw..]).all(|(a, b)| (a - b).abs() < 1e-5), "row {i}");
        }
        assert_eq!(cache.bytes_in_use(), n * 2 * kw * 4);
    }

    #[test]
    fn writes_past_capacity_or_gaps_are_errors() {
        let shape = AttnShape { n_heads: 2, n_kv_heads: 1, head_dim: 4 };
        let mut cache = KvCache::new(KvKind::F16, shape, 2, 2);
        let (k, q) = (vec![0.5; 4], vec![0.5; 8]);
        let mut out = vec![0.0; 8];
        assert!(matches!(cache.write_and_attend(0, 2, &k, &k, &q, &mut out), Err(Error::ContextLength { needed: 3, limit: 2 })));
        assert!(matches!(cache.write_and_attend(1, 1, &k, &k, &q, &mut out), Err(Error::Internal(_))));
        cache.write_and_attend(0, 0, &k, &k, &q, &mut out).unwrap();
        assert!(out.iter().all(|x| (x - 0.5).abs() < 1e-3)); // one position: output is its value
        assert_eq!(cache.bytes_in_use(), 2 * 4 * 2);
    }
}
