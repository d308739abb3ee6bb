//! Adaptive depth's fill (`loops: "auto"`): a token that stopped looping early keeps, in the slots of the loops it
//! skipped, the K/V of the last loop it ran — so a later token that runs those loops attends to it there (Huginn's
//! rule for skipped recurrences). The copy is of the stored codes and their scales, so it holds exactly what the
//! last loop wrote, in every KV mode.

use super::{KvCache, Slot, SlotBuf};
use crate::error::{Error, Result};
use crate::kv::attend::{Ctx, RowLayout};
use crate::kv::elem::KvElem;

impl KvCache {
    /// Copy position `pos`'s K/V from slot `from` into slot `to`, which must already hold every position before it
    /// (positions after it, written in the same pass, stay).
    /// Nothing to do when both are one slot (loops sharing their KV).
    pub fn copy_position(&mut self, from: usize, to: usize, pos: usize) -> Result<()> {
        let (from, to) = (self.physical(from), self.physical(to));
        if from == to {
            return Ok(());
        }
        let ctx = self.ctx();
        if to >= self.slots.len() || from >= self.slots.len() {
            return Err(Error::Internal(format!("no KV slot {}", from.max(to))));
        }
        if self.slots[to].is_none() {
            self.slots[to] = Some(self.empty_slot()?);
        }
        let shape = self.shape;
        let (src, dst) = if from < to {
            let (a, b) = self.slots.split_at_mut(to);
            (&a[from], &mut b[0])
        } else {
            let (a, b) = self.slots.split_at_mut(from);
            (&b[0], &mut a[to])
        };
        let Some(src) = src.as_ref() else {
            return Err(Error::Internal(format!("KV slot {from} was never written")));
        };
        let Some(dst) = dst.as_mut() else {
            return Err(Error::Internal(format!("KV slot {to} vanished")));
        };
        match (src, dst) {
            (SlotBuf::F32(a), SlotBuf::F32(b)) => b.copy_position(a, ctx, pos),
            (SlotBuf::F16(a), SlotBuf::F16(b)) => b.copy_position(a, ctx, pos),
            (SlotBuf::I8(a), SlotBuf::I8(b)) => b.copy_position(a, ctx, pos),
            (SlotBuf::I4(a), SlotBuf::I4(b)) => b.copy_position(a, ctx, pos),
            (SlotBuf::Dev(a), SlotBuf::Dev(b)) => b.copy_position(a, shape, ctx.cap, pos),
            _ => Err(Error::Internal("KV slots of different kinds".into())),
        }
    }
}

impl<T: KvElem> Slot<T> {
    fn copy_position(&mut self, src: &Self, ctx: Ctx, pos: usize) -> Result<()> {
        if pos < src.base || pos >= src.len || pos > self.len {
            return Err(Error::Internal(format!("cannot copy KV position {pos} between these slots")));
        }
        let at = [pos];
        let visible = [pos + 1];
        self.make_room(ctx, &RowLayout { store: &at, prefix: &visible, extra: &[], pos: &at, fills: &[] })?;
        let (heads, w) = (ctx.shape.n_kv_heads, ctx.shape.head_dim / T::PACK);
        let (to, from) = (pos - self.base, pos - src.base);
        for g in 0..heads {
            let (d, s) = (g * self.stride + to, g * src.stride + from);
            self.k[d * w..(d + 1) * w].copy_from_slice(&src.k[s * w..(s + 1) * w]);
            self.v[d * w..(d + 1) * w].copy_from_slice(&src.v[s * w..(s + 1) * w]);
            self.k_meta[d] = src.k_meta[s];
            self.v_meta[d] = src.v_meta[s];
        }
        self.len = self.len.max(pos + 1);
        Ok(())
    }
}
