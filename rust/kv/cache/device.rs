//! A cache in device memory, for a model on a candle device (`model::Compute::Device`): its slots are `DevSlot`s
//! (`dev_slot.rs`) in f16 (f32 for F32 models). Every slot operation the
//! cache offers (rollback, loops sharing KV, adaptive depth's fills, prompt-cache prefixes) works on them; a device
//! slot holds contiguous causal rows only: tree rows and sliding windows are refused before a request starts
//! (`Generator::new`), and the quantized KV modes when the engine loads.

use candle_core::{DType, Device, Tensor};

use super::dev_slot::DevSlot;
use super::stride::next_stride;
use super::{KvCache, KvKind, Slot, SlotBuf};
use crate::error::{Error, Result};

/// The element type of a device cache of `kind` (only "fp16" exists on a device: f16, or f32 for F32 models).
pub(super) fn dtype(kind: KvKind) -> Result<DType> {
    match kind {
        KvKind::F32 => Ok(DType::F32),
        KvKind::F16 => Ok(DType::F16),
        other => Err(Error::Internal(format!("KV mode {} has no device slots", other.name()))),
    }
}

/// The same rows in a host slot (the prompt cache's files are written from host slots).
pub(super) fn to_host(slot: &DevSlot) -> Result<SlotBuf> {
    let (k, v) = (slot.k.flatten_all()?, slot.v.flatten_all()?);
    let (base, len, stride) = (0, slot.len, slot.stride);
    Ok(match slot.k.dtype() {
        DType::F32 => {
            let (k, v) = (k.to_vec1()?, v.to_vec1()?);
            let meta = vec![(); slot.k.dims()[0] * stride];
            SlotBuf::F32(Slot { k, v, k_meta: meta.clone(), v_meta: meta, base, len, stride })
        }
        _ => {
            let (k, v) = (k.to_dtype(DType::F16)?.to_vec1()?, v.to_dtype(DType::F16)?.to_vec1()?);
            let meta = vec![(); slot.k.dims()[0] * stride];
            SlotBuf::F16(Slot { k, v, k_meta: meta.clone(), v_meta: meta, base, len, stride })
        }
    })
}

impl KvCache {
    /// Put this cache's slots in `device`'s memory from now on (a cache for a model on a candle device; its kind
    /// must be "fp16"'s, which `Engine::load_on` makes sure of — any other fails at the first write).
    pub fn on_device(mut self, device: &Device) -> Self {
        self.device = Some(device.clone());
        self
    }

    /// A slot with nothing written: on this cache's device, or on the host.
    pub(super) fn empty_slot(&self) -> Result<SlotBuf> {
        match &self.device {
            Some(device) => {
                let stride = next_stride(0, 1, self.capacity);
                Ok(SlotBuf::Dev(DevSlot::new(self.shape, dtype(self.kind)?, device, stride)?))
            }
            None => Ok(SlotBuf::empty(self.kind)),
        }
    }

    /// The device this cache's slots live on, if not the host.
    pub fn device(&self) -> Option<&Device> {
        self.device.as_ref()
    }

    /// `write_and_attend` on a device: K/V rows for positions `pos..pos + n` into `slot`, then (after `fills`:
    /// adaptive depth's copies, as in `RowLayout::fills`) the `n` query rows' causal attention over it.
    /// `k`, `v`: `(n, n_kv_heads·head_dim)`; `q` and the result: `(n, n_heads·head_dim)`.
    pub fn attend_on_device(
        &mut self,
        slot: usize,
        pos: usize,
        k: &Tensor,
        v: &Tensor,
        q: &Tensor,
        fills: &[(usize, usize)],
    ) -> Result<Tensor> {
        let (shape, cap) = (self.shape, self.capacity);
        let n = k.dim(0)?;
        if pos + n > cap {
            return Err(Error::ContextLength { needed: pos + n, limit: cap });
        }
        let Some(device) = self.device.clone() else {
            return Err(Error::Internal("device attention on a host cache".into()));
        };
        if self.window > 0 {
            return Err(Error::Internal("a sliding window on a device cache".into()));
        }
        let (logical, physical) = (slot, self.physical(slot));
        if pos > self.slot_len(logical) {
            return Err(Error::Internal(format!("slot {physical} holds fewer than {pos} positions")));
        }
        let dtype = dtype(self.kind)?;
        let entry = self.slots.get_mut(physical).ok_or_else(|| Error::Internal(format!("no KV slot {physical}")))?;
        if entry.is_none() {
            let stride = next_stride(0, pos + n, cap);
            *entry = Some(SlotBuf::Dev(DevSlot::new(shape, dtype, &device, stride)?));
        }
        let Some(SlotBuf::Dev(s)) = entry else {
            return Err(Error::Internal(format!("KV slot {physical} is not in device memory")));
        };
        s.write(shape, cap, pos, k, v)?;
        for &(row, from) in fills {
            self.copy_position(from, logical, pos + row)?;
        }
        match &self.slots[physical] {
            Some(SlotBuf::Dev(s)) => s.attend(shape, pos, q),
            _ => Err(Error::Internal(format!("KV slot {physical} is not in device memory"))),
        }
    }
}
