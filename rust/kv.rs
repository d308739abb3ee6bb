//! The KV cache: one slot per (prelude layer) and per (loop, block layer), each preallocated for the sequence's
//! capacity and written in place. Each slot keeps its own length, because a draft pass fills only the first
//! loops' slots and verification fills the rest later; `truncate` rolls every slot back at once.
//!
//! Element types: f32 for models whose weights are F32 and f16 for every other model (together the reference's
//! "fp16" mode), or int8 ("int8": symmetric, one f32 scale per token and KV head, `x ≈ scale · q`, `q ∈ [-127, 127]`).
//! Slot layout is `[kv_head][position][head_dim]`, so one head's keys are contiguous for the attention dot products;
//! int8 scales are `[kv_head][position]`.

use half::f16;
use rayon::prelude::*;

use crate::error::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvKind {
    F32,
    F16,
    Int8,
}

impl KvKind {
    /// Bytes one token takes in one (K or V) head row of `head_dim` values, scale included.
    pub fn bytes_per_row(self, head_dim: usize) -> usize {
        match self {
            KvKind::F32 => 4 * head_dim,
            KvKind::F16 => 2 * head_dim,
            KvKind::Int8 => head_dim + 4,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvKind::F32 => "f32",
            KvKind::F16 => "f16",
            KvKind::Int8 => "int8",
        }
    }
}

pub trait KvElem: Copy + Send + Sync + Default + 'static {
    /// Whether rows carry a scale (`value = scale · element`).
    const SCALED: bool = false;
    fn from_f32(x: f32) -> Self;
    fn to_f32(self) -> f32;
    /// Store one head row; returns its scale (1 for unscaled types).
    fn encode_row(row: &[f32], out: &mut [Self]) -> f32 {
        for (o, &x) in out.iter_mut().zip(row) {
            *o = Self::from_f32(x);
        }
        1.0
    }
}

impl KvElem for i8 {
    const SCALED: bool = true;
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x.round().clamp(-127.0, 127.0) as i8
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self as f32
    }
    fn encode_row(row: &[f32], out: &mut [Self]) -> f32 {
        let amax = row.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        let scale = amax / 127.0;
        let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
        for (o, &x) in out.iter_mut().zip(row) {
            *o = Self::from_f32(x * inv);
        }
        scale
    }
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
    /// Per (kv_head, position) scales of K and V; empty for unscaled element types.
    k_scale: Vec<f32>,
    v_scale: Vec<f32>,
    len: usize,
}

impl<T: KvElem> Slot<T> {
    fn new(heads: usize, cap: usize, hd: usize) -> Self {
        let scales = if T::SCALED { heads * cap } else { 0 };
        Self { k: vec![T::default(); heads * cap * hd], v: vec![T::default(); heads * cap * hd],
               k_scale: vec![0.0; scales], v_scale: vec![0.0; scales], len: 0 }
    }
}

enum SlotBuf {
    F32(Slot<f32>),
    F16(Slot<f16>),
    I8(Slot<i8>),
}

macro_rules! each_slot {
    ($buf:expr, $s:ident => $body:expr) => {
        match $buf {
            SlotBuf::F32($s) => $body,
            SlotBuf::F16($s) => $body,
            SlotBuf::I8($s) => $body,
        }
    };
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
            Some(Some(buf)) => each_slot!(buf, s => s.len),
            _ => 0,
        }
    }

    /// Roll every slot back to at most `len` positions. Nothing is freed; later writes overwrite in place.
    pub fn truncate(&mut self, len: usize) {
        for slot in self.slots.iter_mut().flatten() {
            each_slot!(slot, s => s.len = s.len.min(len));
        }
    }

    /// Bytes of K/V holding live positions (what the metrics report).
    pub fn bytes_in_use(&self) -> usize {
        let per_pos = 2 * self.shape.n_kv_heads * self.kind.bytes_per_row(self.shape.head_dim);
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
        let entry = self.slots.get_mut(slot).ok_or_else(|| Error::Internal(format!("no KV slot {slot}")))?;
        let buf = entry.get_or_insert_with(|| match self.kind {
            KvKind::F32 => SlotBuf::F32(Slot::new(n_kv_heads, cap, head_dim)),
            KvKind::F16 => SlotBuf::F16(Slot::new(n_kv_heads, cap, head_dim)),
            KvKind::Int8 => SlotBuf::I8(Slot::new(n_kv_heads, cap, head_dim)),
        });
        each_slot!(buf, s => s.write_and_attend(shape, cap, layout, k, v, q, out));
        Ok(())
    }

    /// Move the K/V stored at index `from` to index `to` in every slot that holds it (tree compaction).
    pub fn move_position(&mut self, from: usize, to: usize) {
        let width = self.shape.head_dim;
        let (heads, cap) = (self.shape.n_kv_heads, self.capacity);
        for slot in self.slots.iter_mut().flatten() {
            each_slot!(slot, s => s.move_position(heads, cap, width, from, to));
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
                let ks = T::encode_row(&k[src..src + hd], &mut self.k[dst..dst + hd]);
                let vs = T::encode_row(&v[src..src + hd], &mut self.v[dst..dst + hd]);
                if T::SCALED {
                    self.k_scale[g * cap + at] = ks;
                    self.v_scale[g * cap + at] = vs;
                }
            }
        }
        self.len = layout.store.iter().max().map_or(self.len, |m| m + 1);
        let group = n_heads / n_kv_heads;
        let scale = 1.0 / (hd as f32).sqrt();
        let (ks, vs, kss, vss) = (&self.k, &self.v, &self.k_scale, &self.v_scale);
        const NONE: &[usize] = &[];
        // One task per (row, head); each writes its own head_dim-wide piece of `out`.
        let task = |(idx, o): (usize, &mut [f32])| {
            let (i, h) = (idx / n_heads, idx % n_heads);
            let base = (h / group) * cap * hd;
            let extra = layout.extra.get(i).map_or(NONE, Vec::as_slice);
            let g = h / group;
            let scales = if T::SCALED { Some((&kss[g * cap..(g + 1) * cap], &vss[g * cap..(g + 1) * cap])) } else { None };
            let head = (&ks[base..base + cap * hd], &vs[base..base + cap * hd], scales);
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
            if T::SCALED {
                self.k_scale[g * cap + to] = self.k_scale[g * cap + from];
                self.v_scale[g * cap + to] = self.v_scale[g * cap + from];
            }
        }
    }
}

/// One KV head's keys and values, `[position][head_dim]`, and their per-position scales for scaled types.
type HeadView<'a, T> = (&'a [T], &'a [T], Option<(&'a [f32], &'a [f32])>);

/// softmax(q·Kᵀ·scale)·V for one query row over key indices `0..prefix` and `extra`, accumulated in f32.
fn attend_one<T: KvElem>(q: &[f32], head: HeadView<T>, prefix: usize, extra: &[usize], hd: usize, scale: f32, out: &mut [f32]) {
    let (keys, values, scales) = head;
    let k_scale = |t: usize| scales.map_or(1.0, |s| s.0[t]);
    let v_scale = |t: usize| scales.map_or(1.0, |s| s.1[t]);
    let dot = |t: usize| keys[t * hd..(t + 1) * hd].iter().zip(q).map(|(a, b)| a.to_f32() * b).sum::<f32>() * scale * k_scale(t);
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
        let t = index(j);
        let w = p / sum * v_scale(t);
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
