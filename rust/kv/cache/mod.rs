//! The KV cache: one slot per (prelude layer) and per (loop, block layer), written in place. A slot's buffers grow
//! with the positions it holds (doubling, up to the sequence's capacity), so a request costs memory for the context
//! it uses, not for the whole context length: 16 fresh requests on a 2,048-wide model with 32 slots would
//! otherwise zero 4 GiB before their first token. Each slot keeps its own length, because a draft pass fills only
//! the first loops' slots and verification fills the rest later; `truncate` rolls every slot back at once.
//!
//! Modes (`KvKind`, element formats in `elem.rs`): f32 for models whose weights are F32 and f16 for every other
//! model (together the API's "fp16"), "int8", "int4", and "int4-h" (int4 after a Hadamard rotation of each head).
//! Slot layout is `[kv_head][stride][head_dim]` (`stride`: the positions allocated per head), so one head's keys are
//! contiguous for the attention dot products; per-row metadata (scales) is `[kv_head][stride]`.
//!
//! Sliding window (`cache_window = W > 0`): a row at position p attends to positions `p-W+1..=p` only, and a slot
//! keeps just the positions some future row can still see (plus `WINDOW_SLACK` for speculative rollback): when a
//! write would run past the capacity, older positions are dropped by moving the live ones to the front (`base` is
//! the position stored at index 0). RoPE positions stay absolute, since K is stored already rotated.

use candle_core::Device;
use half::f16;

use crate::error::{Error, Result};
use crate::kernels::AttnShape;
use crate::kv::attend::{attend, Ctx, RowLayout, SlotView};
use crate::kv::elem::{hadamard, KvElem, Nibbles};
use crate::limits::WINDOW_SLACK;
use stride::next_stride;

mod dev_slot;
mod device;
mod fill;
mod share;
mod snapshot;
mod stride;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvKind {
    F32,
    F16,
    Int8,
    Int4,
    /// int4 of Hadamard-rotated head rows.
    Int4H,
}

impl KvKind {
    /// Bytes one token takes in one (K or V) head row of `head_dim` values, metadata included.
    pub fn bytes_per_row(self, head_dim: usize) -> usize {
        match self {
            KvKind::F32 => 4 * head_dim,
            KvKind::F16 => 2 * head_dim,
            KvKind::Int8 => head_dim + 4,
            KvKind::Int4 | KvKind::Int4H => head_dim / 2 + 4,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvKind::F32 => "f32",
            KvKind::F16 => "f16",
            KvKind::Int8 => "int8",
            KvKind::Int4 => "int4",
            KvKind::Int4H => "int4-h",
        }
    }
}

struct Slot<T: KvElem> {
    k: Vec<T>,
    v: Vec<T>,
    k_meta: Vec<T::Meta>,
    v_meta: Vec<T::Meta>,
    /// Position stored at index 0 (> 0 only once a window has dropped older positions).
    base: usize,
    /// One past the last position held.
    len: usize,
    /// Positions allocated per head (grows up to the cache's capacity).
    stride: usize,
}

impl<T: KvElem> Slot<T> {
    fn new() -> Self {
        Self { k: Vec::new(), v: Vec::new(), k_meta: Vec::new(), v_meta: Vec::new(), base: 0, len: 0, stride: 0 }
    }

    /// Make room for indices `0..need` in every head: at least double the stride (bounded by `cap`), moving each
    /// head's held rows to the new layout.
    fn reserve(&mut self, heads: usize, hd: usize, need: usize, cap: usize) {
        if need <= self.stride {
            return;
        }
        let stride = next_stride(self.stride, need, cap);
        let (w, held) = (hd / T::PACK, self.len - self.base);
        let regrow = |old: &[T], old_stride: usize| {
            let mut new = vec![T::default(); heads * stride * w];
            for g in 0..heads {
                new[g * stride * w..][..held * w].copy_from_slice(&old[g * old_stride * w..][..held * w]);
            }
            new
        };
        let regrow_meta = |old: &[T::Meta], old_stride: usize| {
            let mut new = vec![T::Meta::default(); heads * stride];
            for g in 0..heads {
                new[g * stride..][..held].copy_from_slice(&old[g * old_stride..][..held]);
            }
            new
        };
        (self.k, self.v) = (regrow(&self.k, self.stride), regrow(&self.v, self.stride));
        (self.k_meta, self.v_meta) = (regrow_meta(&self.k_meta, self.stride), regrow_meta(&self.v_meta, self.stride));
        self.stride = stride;
    }
}

enum SlotBuf {
    F32(Slot<f32>),
    F16(Slot<f16>),
    I8(Slot<i8>),
    I4(Slot<Nibbles>),
    /// In device memory (`device.rs`).
    Dev(dev_slot::DevSlot),
}

impl SlotBuf {
    fn empty(kind: KvKind) -> Self {
        match kind {
            KvKind::F32 => SlotBuf::F32(Slot::new()),
            KvKind::F16 => SlotBuf::F16(Slot::new()),
            KvKind::Int8 => SlotBuf::I8(Slot::new()),
            KvKind::Int4 | KvKind::Int4H => SlotBuf::I4(Slot::new()),
        }
    }
}

macro_rules! each_slot {
    ($buf:expr, $s:ident => $body:expr) => {
        match $buf {
            SlotBuf::F32($s) => $body,
            SlotBuf::F16($s) => $body,
            SlotBuf::I8($s) => $body,
            SlotBuf::I4($s) => $body,
            SlotBuf::Dev($s) => $body,
        }
    };
}

/// `each_slot!` over the host formats, `$dev` for a device slot.
macro_rules! each_host_slot {
    ($buf:expr, $s:ident => $body:expr, device => $dev:expr) => {
        match $buf {
            SlotBuf::F32($s) => $body,
            SlotBuf::F16($s) => $body,
            SlotBuf::I8($s) => $body,
            SlotBuf::I4($s) => $body,
            SlotBuf::Dev(_) => $dev,
        }
    };
}

/// Where the loops' slots start and how many layers a loop has, for a cache whose loops share KV (`share.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoopShare {
    prelude: usize,
    block: usize,
    /// Set by `collapse`: loop slots now alias their layer's one slot.
    collapsed: bool,
}

pub struct KvCache {
    kind: KvKind,
    shape: AttnShape,
    capacity: usize,
    /// Sliding window W (0: every earlier position is visible).
    window: usize,
    slots: Vec<Option<SlotBuf>>,
    /// Loops share one slot per block layer once the prompt is in (`share.rs`); `None`: a slot per (loop, layer).
    share: Option<LoopShare>,
    /// Where new slots live: a candle device's memory (`device.rs`), or the host.
    device: Option<Device>,
}

impl KvCache {
    pub fn new(kind: KvKind, shape: AttnShape, capacity: usize, n_slots: usize) -> Self {
        Self {
            kind,
            shape,
            capacity,
            window: 0,
            slots: (0..n_slots).map(|_| None).collect(),
            share: None,
            device: None,
        }
    }

    /// Restrict attention to the last `window` positions (0: no window) and let slots drop older ones.
    pub fn with_window(mut self, window: usize) -> Self {
        self.window = window;
        self
    }

    pub fn kind(&self) -> KvKind {
        self.kind
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn window(&self) -> usize {
        self.window
    }

    /// Positions held by `slot` (0 if never written): one past the last, counting dropped ones.
    pub fn slot_len(&self, slot: usize) -> usize {
        match self.slots.get(self.physical(slot)) {
            Some(Some(buf)) => each_slot!(buf, s => s.len),
            _ => 0,
        }
    }

    /// Roll every slot back to at most `len` positions. Nothing is freed; later writes overwrite in place.
    pub fn truncate(&mut self, len: usize) {
        for slot in self.slots.iter_mut().flatten() {
            each_slot!(slot, s => {
                debug_assert!(len >= s.base, "rollback below the window's dropped positions");
                s.len = s.len.min(len).max(s.base)
            });
        }
    }

    /// Bytes of K/V holding live positions (what the metrics report).
    pub fn bytes_in_use(&self) -> usize {
        let per_pos = 2 * self.shape.n_kv_heads * self.kind.bytes_per_row(self.shape.head_dim);
        self.slots.iter().flatten().map(|b| each_slot!(b, s => s.len - s.base) * per_pos).sum()
    }

    /// Write K/V rows for positions `pos..pos+n` into `slot`, then attend the `n` query rows causally over the slot.
    /// `k`, `v`: `(n, n_kv_heads*head_dim)`; `q`, `out`: `(n, n_heads*head_dim)`, row i at position `pos + i`.
    pub fn write_and_attend(
        &mut self,
        slot: usize,
        pos: usize,
        k: &[f32],
        v: &[f32],
        q: &[f32],
        out: &mut [f32],
    ) -> Result<()> {
        let n = k.len() / (self.shape.n_kv_heads * self.shape.head_dim).max(1);
        let store: Vec<usize> = (pos..pos + n).collect();
        let visible: Vec<usize> = (pos + 1..=pos + n).collect();
        let layout = RowLayout { store: &store, prefix: &visible, extra: &[], pos: &store, fills: &[] };
        self.write_rows_and_attend(slot, &layout, k, v, q, out)
    }

    /// The general form: row i is stored at index `layout.store[i]` and attends to indices `0..layout.prefix[i]`
    /// (from `layout.pos[i] - W + 1` with a window) plus `layout.extra[i]` (tree verification: a node sees its
    /// ancestors and itself, not its siblings).
    pub fn write_rows_and_attend(
        &mut self,
        slot: usize,
        layout: &RowLayout,
        k: &[f32],
        v: &[f32],
        q: &[f32],
        out: &mut [f32],
    ) -> Result<()> {
        let AttnShape { n_heads, n_kv_heads, head_dim } = self.shape;
        let kvw = n_kv_heads * head_dim;
        let n = layout.store.len();
        if n == 0
            || k.len() != n * kvw
            || v.len() != k.len()
            || q.len() != n * n_heads * head_dim
            || out.len() != q.len()
            || layout.prefix.len() != n
            || layout.pos.len() != n
            || !(layout.extra.is_empty() || layout.extra.len() == n)
        {
            return Err(Error::Internal(format!("attention: bad row shapes for slot {slot}")));
        }
        let (lo, hi) =
            (layout.store.iter().min().copied().unwrap_or(0), layout.store.iter().max().copied().unwrap_or(0));
        if self.window == 0 && hi >= self.capacity {
            return Err(Error::ContextLength { needed: hi + 1, limit: self.capacity });
        }
        let have = self.slot_len(slot);
        let logical = slot;
        let slot = self.physical(slot);
        if lo > have {
            return Err(Error::Internal(format!("slot {slot} holds {have} positions, cannot write at {lo}")));
        }
        let (ctx, kind) = (self.ctx(), self.kind);
        let entry = self.slots.get_mut(slot).ok_or_else(|| Error::Internal(format!("no KV slot {slot}")))?;
        let buf = entry.get_or_insert_with(|| SlotBuf::empty(kind));
        let on_device = || Error::Internal(format!("KV slot {slot} is in device memory"));
        each_host_slot!(buf, s => s.write(ctx, layout, k, v), device => Err(on_device()))?;
        for &(row, from) in layout.fills {
            self.copy_position(from, logical, layout.store[row])?;
        }
        let buf = self.slots[slot].as_ref().ok_or_else(|| Error::Internal(format!("no KV slot {slot}")))?;
        each_host_slot!(buf, s => attend(s.view(), ctx, layout, q, out), device => return Err(on_device()));
        Ok(())
    }

    /// What a write or copy needs to know of this cache.
    fn ctx(&self) -> Ctx {
        Ctx { shape: self.shape, cap: self.capacity, window: self.window, rotate: self.kind == KvKind::Int4H }
    }

    /// A cache of `capacity` positions (window `window`) holding this one's first `n` positions in every slot that
    /// was written — `None` when some written slot does not hold all of them from position 0 (a window dropped
    /// some, or a shallower pass filled it less far), so a partial prefix is never handed out.
    pub fn prefix(&self, n: usize, capacity: usize, window: usize) -> Option<KvCache> {
        let (heads, hd) = (self.shape.n_kv_heads, self.shape.head_dim);
        let mut slots = Vec::with_capacity(self.slots.len());
        for slot in &self.slots {
            slots.push(match slot {
                None => None,
                Some(buf) => Some(match buf {
                    SlotBuf::F32(s) => SlotBuf::F32(s.head_rows(heads, hd, n, capacity)?),
                    SlotBuf::F16(s) => SlotBuf::F16(s.head_rows(heads, hd, n, capacity)?),
                    SlotBuf::I8(s) => SlotBuf::I8(s.head_rows(heads, hd, n, capacity)?),
                    SlotBuf::I4(s) => SlotBuf::I4(s.head_rows(heads, hd, n, capacity)?),
                    SlotBuf::Dev(s) => SlotBuf::Dev(s.head_rows(self.shape, n, capacity).ok()??),
                }),
            });
        }
        let device = self.device.clone();
        Some(KvCache { kind: self.kind, shape: self.shape, capacity, window, slots, share: self.share, device })
    }

    /// Positions every written slot holds from position 0 (0 when none was written or a window dropped some).
    pub fn complete_positions(&self) -> usize {
        let mut held = self.slots.iter().flatten().map(|b| each_slot!(b, s => if s.base > 0 { 0 } else { s.len }));
        let first = held.next().unwrap_or(0);
        held.fold(first, usize::min)
    }

    /// Bytes the slots have allocated (what a cache kept aside costs, live positions or not).
    pub fn bytes_allocated(&self) -> usize {
        let (heads, w) = (self.shape.n_kv_heads, self.kind.bytes_per_row(self.shape.head_dim));
        self.slots.iter().flatten().map(|b| each_slot!(b, s => 2 * heads * s.stride * w)).sum()
    }

    /// Move the K/V stored at position `from` to position `to` in every slot that holds it (tree compaction).
    pub fn move_position(&mut self, from: usize, to: usize) -> Result<()> {
        let (heads, hd) = (self.shape.n_kv_heads, self.shape.head_dim);
        for slot in self.slots.iter_mut().flatten() {
            match slot {
                SlotBuf::Dev(s) => s.move_position(from, to)?,
                host => each_host_slot!(host, s => s.move_position(heads, hd, from, to), device => ()),
            }
        }
        Ok(())
    }
}

impl<T: KvElem> Slot<T> {
    /// Drop positions below `keep` by moving `keep..len` to the front of every head.
    fn compact(&mut self, heads: usize, hd: usize, keep: usize) {
        let (shift, live, cap) = (keep - self.base, self.len - keep, self.stride);
        let w = hd / T::PACK;
        for g in 0..heads {
            let (src, dst) = ((g * cap + shift) * w, g * cap * w);
            self.k.copy_within(src..src + live * w, dst);
            self.v.copy_within(src..src + live * w, dst);
            let (ms, md) = (g * cap + shift, g * cap);
            self.k_meta.copy_within(ms..ms + live, md);
            self.v_meta.copy_within(ms..ms + live, md);
        }
        self.base = keep;
    }

    /// Store the rows' K/V at their indices, first dropping positions no row can see any more when the
    /// window's capacity would be exceeded.
    fn write(&mut self, ctx: Ctx, layout: &RowLayout, k: &[f32], v: &[f32]) -> Result<()> {
        let Ctx { shape: AttnShape { n_kv_heads, head_dim: hd, .. }, rotate, .. } = ctx;
        let w = hd / T::PACK;
        self.make_room(ctx, layout)?;
        let cap = self.stride;
        let mut tmp = vec![0f32; hd];
        for (i, &at) in layout.store.iter().enumerate() {
            let at = at - self.base;
            for g in 0..n_kv_heads {
                let src = (i * n_kv_heads + g) * hd;
                let (dst, m) = ((g * cap + at) * w, g * cap + at);
                for (rows, codes, meta) in [(k, &mut self.k, &mut self.k_meta), (v, &mut self.v, &mut self.v_meta)] {
                    tmp.copy_from_slice(&rows[src..src + hd]);
                    if rotate {
                        hadamard(&mut tmp);
                    }
                    meta[m] = T::encode_row(&tmp, &mut codes[dst..dst + w]);
                }
            }
        }
        self.len = layout.store.iter().max().copied().unwrap_or(0) + 1;
        Ok(())
    }

    /// Make `layout`'s store indices writable: first drop positions no row can see any more when the window's
    /// capacity would be exceeded, then grow the buffers.
    fn make_room(&mut self, ctx: Ctx, layout: &RowLayout) -> Result<()> {
        let Ctx { shape: AttnShape { n_kv_heads, head_dim: hd, .. }, cap, window, .. } = ctx;
        let lo_store = layout.store.iter().min().copied().unwrap_or(0);
        let hi = layout.store.iter().max().copied().unwrap_or(0);
        if lo_store < self.base {
            return Err(Error::Internal(format!("position {lo_store} was already dropped by the KV window")));
        }
        if hi - self.base >= cap {
            let oldest = (0..layout.store.len()).map(|i| layout.visible_from(i, window)).min().unwrap_or(0);
            let keep = oldest.saturating_sub(WINDOW_SLACK).max(self.base).min(lo_store).min(self.len);
            if hi - keep >= cap {
                return Err(Error::Internal(format!("KV window capacity {cap} too small for position {hi}")));
            }
            self.compact(n_kv_heads, hd, keep);
        }
        self.reserve(n_kv_heads, hd, hi + 1 - self.base, cap);
        Ok(())
    }

    /// A copy of positions `0..n` (every head), allocating `n` per head (at least the first stride, at most `cap`);
    /// `None` unless this slot holds all of them.
    fn head_rows(&self, heads: usize, hd: usize, n: usize, cap: usize) -> Option<Self> {
        if self.base > 0 || self.len < n {
            return None;
        }
        let mut out = Slot::new();
        out.reserve(heads, hd, n, cap);
        let (w, (from, to)) = (hd / T::PACK, (self.stride, out.stride));
        for g in 0..heads {
            out.k[g * to * w..][..n * w].copy_from_slice(&self.k[g * from * w..][..n * w]);
            out.v[g * to * w..][..n * w].copy_from_slice(&self.v[g * from * w..][..n * w]);
            out.k_meta[g * to..][..n].copy_from_slice(&self.k_meta[g * from..][..n]);
            out.v_meta[g * to..][..n].copy_from_slice(&self.v_meta[g * from..][..n]);
        }
        out.len = n;
        Some(out)
    }

    /// What attention reads of this slot.
    fn view(&self) -> SlotView<'_, T> {
        SlotView {
            keys: &self.k,
            values: &self.v,
            k_meta: &self.k_meta,
            v_meta: &self.v_meta,
            base: self.base,
            stride: self.stride,
        }
    }

    fn move_position(&mut self, heads: usize, hd: usize, from: usize, to: usize) {
        if from >= self.len || from < self.base || to < self.base {
            return;
        }
        let (from, to, w, cap) = (from - self.base, to - self.base, hd / T::PACK, self.stride);
        for g in 0..heads {
            let (src, dst) = ((g * cap + from) * w, (g * cap + to) * w);
            self.k.copy_within(src..src + w, dst);
            self.v.copy_within(src..src + w, dst);
            self.k_meta[g * cap + to] = self.k_meta[g * cap + from];
            self.v_meta[g * cap + to] = self.v_meta[g * cap + from];
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
        naive_window(shape, q, k, v, 0)
    }

    /// Causal attention where row i sees rows `i-window+1..=i` (all earlier rows when `window` is 0).
    fn naive_window(shape: AttnShape, q: &[f32], k: &[f32], v: &[f32], window: usize) -> Vec<f32> {
        let AttnShape { n_heads, n_kv_heads, head_dim: hd } = shape;
        let n = q.len() / (n_heads * hd);
        let mut out = vec![0.0; q.len()];
        for i in 0..n {
            let from = if window > 0 { (i + 1).saturating_sub(window) } else { 0 };
            for h in 0..n_heads {
                let g = h / (n_heads / n_kv_heads);
                let qv = &q[(i * n_heads + h) * hd..][..hd];
                let s: Vec<f32> = (from..=i)
                    .map(|t| {
                        (0..hd).map(|d| qv[d] * k[(t * n_kv_heads + g) * hd + d]).sum::<f32>() / (hd as f32).sqrt()
                    })
                    .collect();
                let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let z: f32 = s.iter().map(|x| (x - m).exp()).sum();
                for (j, t) in (from..=i).enumerate() {
                    for d in 0..hd {
                        out[(i * n_heads + h) * hd + d] += (s[j] - m).exp() / z * v[(t * n_kv_heads + g) * hd + d];
                    }
                }
            }
        }
        out
    }

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
    }

    #[test]
    fn window_matches_naive_through_compaction_and_rollback() {
        let shape = AttnShape { n_heads: 2, n_kv_heads: 1, head_dim: 8 };
        let (n, qw, kw, window) = (400, 16, 8, 5);
        let (q, k, v) = (pseudo(n * qw, 4), pseudo(n * kw, 5), pseudo(n * kw, 6));
        let want = naive_window(shape, &q, &k, &v, window);
        // Capacity far below the sequence: the slot must drop old positions to keep going.
        let cap = window + WINDOW_SLACK + 10;
        let mut cache = KvCache::new(KvKind::F32, shape, cap, 1).with_window(window);
        let mut out = vec![0.0; 8 * qw];
        cache.write_and_attend(0, 0, &k[..8 * kw], &v[..8 * kw], &q[..8 * qw], &mut out).unwrap();
        assert!(max_diff(&out, &want[..8 * qw]) < 1e-5);
        let mut i = 8;
        while i < n {
            // Every 7th step: write 3 speculative rows, then roll 2 of them back.
            let m = if i % 7 == 0 && i + 3 <= n { 3 } else { 1 };
            let mut o = vec![0.0; m * qw];
            cache
                .write_and_attend(
                    0,
                    i,
                    &k[i * kw..(i + m) * kw],
                    &v[i * kw..(i + m) * kw],
                    &q[i * qw..(i + m) * qw],
                    &mut o,
                )
                .unwrap();
            assert!(max_diff(&o, &want[i * qw..(i + m) * qw]) < 1e-5, "rows {i}..{}", i + m);
            let keep = if m == 3 { 1 } else { m };
            cache.truncate(i + keep);
            i += keep;
            assert!(cache.bytes_in_use() <= cap * 2 * kw * 4, "bytes {} at {i}", cache.bytes_in_use());
        }
        assert_eq!(cache.slot_len(0), n);
    }

    /// Attention error of a quantized mode against f32, over keys whose channel 3 is an outlier.
    fn quantized_error(kind: KvKind) -> f32 {
        let shape = AttnShape { n_heads: 2, n_kv_heads: 2, head_dim: 64 };
        let (n, w) = (48, 128);
        let (q, v) = (pseudo(n * w, 7), pseudo(n * w, 9));
        let mut k = pseudo(n * w, 8);
        for row in k.chunks_mut(64) {
            row[3] *= 40.0;
        }
        let run = |kind| {
            let mut cache = KvCache::new(kind, shape, n, 1);
            let mut out = vec![0.0; n * w];
            cache.write_and_attend(0, 0, &k, &v, &q, &mut out).unwrap();
            out
        };
        max_diff(&run(kind), &run(KvKind::F32))
    }

    #[test]
    fn quantized_modes_order_by_precision_and_hadamard_helps_int4() {
        let (i8e, i4, i4h) =
            (quantized_error(KvKind::Int8), quantized_error(KvKind::Int4), quantized_error(KvKind::Int4H));
        assert!(i8e < 0.05, "int8 {i8e}");
        assert!(i4h < i4, "int4-h {i4h} should beat int4 {i4} on outlier keys");
        assert!(i8e < i4h, "int8 {i8e} vs int4-h {i4h}");
    }

    #[test]
    fn bytes_per_row_of_int4_h_is_under_a_third_of_f16() {
        assert_eq!(KvKind::Int4H.bytes_per_row(64), 36);
        assert!((KvKind::Int4H.bytes_per_row(64) as f64) <= 0.3 * KvKind::F16.bytes_per_row(64) as f64);
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

    /// f16 rows 64 wide take the blocked path (`attn_f16`) when they see contiguous ranges and the per-row one
    /// (`attend_one`) as tree rows: prefill in one chunk, in uneven chunks, decode row by row and tree-shaped rows all
    /// give the same bits, close to f32 attention.
    #[test]
    fn f16_rows_are_the_same_bits_whichever_path_and_chunking() {
        let shape = AttnShape { n_heads: 4, n_kv_heads: 2, head_dim: 64 };
        let (n, qw, kw) = (45, 256, 128);
        let (q, k, v) = (pseudo(n * qw, 11), pseudo(n * kw, 12), pseudo(n * kw, 13));
        let want = naive(shape, &q, &k, &v);
        let run = |chunks: &[usize], tree: bool| {
            let mut cache = KvCache::new(KvKind::F16, shape, 64, 1);
            let mut out = vec![0.0; n * qw];
            let mut at = 0;
            let mut sizes = chunks.iter().copied().chain(std::iter::repeat(1));
            while at < n {
                let m = sizes.next().unwrap_or(1).min(n - at);
                let (rows, o) = ((at..at + m).collect::<Vec<_>>(), &mut out[at * qw..(at + m) * qw]);
                let (kk, vv, qq) = (&k[at * kw..(at + m) * kw], &v[at * kw..(at + m) * kw], &q[at * qw..(at + m) * qw]);
                if tree {
                    // Each row sees the earlier prefix plus the new rows up to itself as "extra" indices.
                    let extra: Vec<Vec<usize>> = rows.iter().map(|&i| (at..=i).collect()).collect();
                    let prefix = vec![at; m];
                    cache
                        .write_rows_and_attend(
                            0,
                            &RowLayout { store: &rows, prefix: &prefix, extra: &extra, pos: &rows, fills: &[] },
                            kk,
                            vv,
                            qq,
                            o,
                        )
                        .unwrap();
                } else {
                    cache.write_and_attend(0, at, kk, vv, qq, o).unwrap();
                }
                at += m;
            }
            out
        };
        let whole = run(&[n], false);
        assert!(max_diff(&whole, &want) < 2e-3, "f16 vs f32 {}", max_diff(&whole, &want));
        let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same(&whole, &run(&[7, 13, 2, 17], false)), "uneven chunks");
        assert!(same(&whole, &run(&[1], false)), "row by row");
        assert!(same(&whole, &run(&[5, 9], true)), "tree rows");
    }

    /// Slots grow as positions arrive (64, then doubling): decoding row by row across two regrowths, with a rollback
    /// on the way, gives the same bits as one prefill that sizes the slot at once; nothing near the capacity is
    /// allocated up front.
    #[test]
    fn growing_slots_keep_every_row_and_allocate_only_what_is_used() {
        let shape = AttnShape { n_heads: 4, n_kv_heads: 2, head_dim: 64 };
        let (n, qw, kw, cap) = (200, 256, 128, 100_000);
        let (q, k, v) = (pseudo(n * qw, 21), pseudo(n * kw, 22), pseudo(n * kw, 23));
        for kind in [KvKind::F32, KvKind::F16, KvKind::Int8, KvKind::Int4H] {
            let mut whole = KvCache::new(kind, shape, cap, 1);
            let mut want = vec![0.0; n * qw];
            whole.write_and_attend(0, 0, &k, &v, &q, &mut want).unwrap();
            let mut grown = KvCache::new(kind, shape, cap, 1);
            let (mut i, mut rolled_back) = (0, false);
            while i < n {
                let mut o = vec![0.0; qw];
                grown
                    .write_and_attend(0, i, &k[i * kw..][..kw], &v[i * kw..][..kw], &q[i * qw..][..qw], &mut o)
                    .unwrap();
                assert_eq!(o, want[i * qw..(i + 1) * qw], "{kind:?} row {i}");
                if i == 130 && !rolled_back {
                    grown.truncate(100); // roll back across a regrowth, then decode again
                    (i, rolled_back) = (100, true);
                } else {
                    i += 1;
                }
            }
            let stride = |c: &KvCache| match &c.slots[0] {
                Some(buf) => each_slot!(buf, s => s.stride),
                None => 0,
            };
            assert_eq!(stride(&grown), 256, "{kind:?}");
            assert_eq!(stride(&whole), 200, "{kind:?}");
        }
    }

    #[test]
    fn writes_past_capacity_or_gaps_are_errors() {
        let shape = AttnShape { n_heads: 2, n_kv_heads: 1, head_dim: 4 };
        let mut cache = KvCache::new(KvKind::F16, shape, 2, 2);
        let (k, q) = (vec![0.5; 4], vec![0.5; 8]);
        let mut out = vec![0.0; 8];
        assert!(matches!(
            cache.write_and_attend(0, 2, &k, &k, &q, &mut out),
            Err(Error::ContextLength { needed: 3, limit: 2 })
        ));
        assert!(matches!(cache.write_and_attend(1, 1, &k, &k, &q, &mut out), Err(Error::Internal(_))));
        cache.write_and_attend(0, 0, &k, &k, &q, &mut out).unwrap();
        assert!(out.iter().all(|x| (x - 0.5).abs() < 1e-3)); // one position: output is its value
        assert_eq!(cache.bytes_in_use(), 2 * 4 * 2);
    }
}
