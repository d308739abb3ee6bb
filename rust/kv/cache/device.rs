//! Slots in device memory, for a model on a candle device (`model::Compute::Device`): K and V as tensors
//! `(n_kv_heads, stride, head_dim)` — the host slots' `[kv_head][stride][head_dim]` layout — in f16 (f32 for F32
//! models), grown by doubling like the host slots, written in place (`Tensor::slice_set`). Every slot operation the
//! cache offers (rollback, loops sharing KV, adaptive depth's fills, prompt-cache prefixes) works on them; a device
//! slot holds contiguous causal rows only: tree rows and sliding windows are refused before a request starts
//! (`Generator::new`), and the quantized KV modes when the engine loads.

use candle_core::{DType, Device, Tensor};

use super::{KvCache, KvKind, Slot, SlotBuf, FIRST_STRIDE};
use crate::error::{Error, Result};
use crate::kernels::AttnShape;

pub(super) struct DevSlot {
    pub k: Tensor,
    pub v: Tensor,
    /// Always 0: device slots never drop positions (no window).
    pub base: usize,
    pub len: usize,
    pub stride: usize,
}

/// The element type of a device cache of `kind` (only "fp16" exists on a device: f16, or f32 for F32 models).
pub(super) fn dtype(kind: KvKind) -> Result<DType> {
    match kind {
        KvKind::F32 => Ok(DType::F32),
        KvKind::F16 => Ok(DType::F16),
        other => Err(Error::Internal(format!("KV mode {} has no device slots", other.name()))),
    }
}

impl DevSlot {
    fn new(shape: AttnShape, dtype: DType, device: &Device, stride: usize) -> Result<Self> {
        let dims = (shape.n_kv_heads, stride, shape.head_dim);
        let (k, v) = (Tensor::zeros(dims, dtype, device)?, Tensor::zeros(dims, dtype, device)?);
        Ok(Self { k, v, base: 0, len: 0, stride })
    }

    /// Make room for positions `0..need`: at least double the stride, up to `cap`.
    fn reserve(&mut self, shape: AttnShape, need: usize, cap: usize) -> Result<()> {
        if need <= self.stride {
            return Ok(());
        }
        let stride = need.max(2 * self.stride).max(FIRST_STRIDE).min(cap.max(need));
        let mut grown = Self::new(shape, self.k.dtype(), self.k.device(), stride)?;
        grown.copy_rows(self, 0, self.len)?;
        grown.len = self.len;
        *self = grown;
        Ok(())
    }

    /// Positions `from..from + n` of `src`'s rows into the same positions here (which must have room).
    fn copy_rows(&mut self, src: &Self, from: usize, n: usize) -> Result<()> {
        if n > 0 {
            self.k.slice_set(&src.k.narrow(1, from, n)?.contiguous()?, 1, from)?;
            self.v.slice_set(&src.v.narrow(1, from, n)?.contiguous()?, 1, from)?;
        }
        Ok(())
    }

    /// Store `k`, `v` (`(n, n_kv_heads·head_dim)`) at positions `pos..pos + n`.
    fn write(&mut self, shape: AttnShape, cap: usize, pos: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        let n = k.dim(0)?;
        self.reserve(shape, pos + n, cap)?;
        let heads = |x: &Tensor| -> Result<Tensor> {
            Ok(x.reshape((n, shape.n_kv_heads, shape.head_dim))?
                .transpose(0, 1)?
                .to_dtype(self.k.dtype())?
                .contiguous()?)
        };
        self.k.slice_set(&heads(k)?, 1, pos)?;
        self.v.slice_set(&heads(v)?, 1, pos)?;
        self.len = pos + n;
        Ok(())
    }

    /// Causal attention of `q (n, n_heads·head_dim)`, row i at position `pos + i`, over positions `0..=pos + i`;
    /// scores, softmax and the weighted sum in f32.
    fn attend(&self, shape: AttnShape, pos: usize, q: &Tensor) -> Result<Tensor> {
        let AttnShape { n_heads, n_kv_heads, head_dim: hd } = shape;
        let (n, group, len) = (q.dim(0)?, n_heads / n_kv_heads, pos + q.dim(0)?);
        // (n, heads, hd) → (kv_heads, group·n, hd): query head h = g·group + r reads KV head g.
        let q = q.reshape((n, n_heads, hd))?.transpose(0, 1)?.contiguous()?.reshape((n_kv_heads, group * n, hd))?;
        let keys = self.k.narrow(1, 0, len)?.to_dtype(DType::F32)?;
        let values = self.v.narrow(1, 0, len)?.to_dtype(DType::F32)?;
        let scores = (q.matmul(&keys.t()?)? / (hd as f64).sqrt())?; // (kv_heads, group·n, len)
        let scores = match n {
            1 => scores,
            _ => {
                let mask: Vec<f32> = (0..n)
                    .flat_map(|i| (0..len).map(move |t| if t <= pos + i { 0.0 } else { f32::NEG_INFINITY }))
                    .collect();
                let mask = Tensor::from_vec(mask, (n, len), q.device())?;
                scores.reshape((n_kv_heads, group, n, len))?.broadcast_add(&mask)?.reshape((
                    n_kv_heads,
                    group * n,
                    len,
                ))?
            }
        };
        let weights = candle_nn::ops::softmax_last_dim(&scores)?;
        let out = weights.matmul(&values)?; // (kv_heads, group·n, hd)
        Ok(out.reshape((n_heads, n, hd))?.transpose(0, 1)?.reshape((n, n_heads * hd))?)
    }

    /// Move position `from`'s rows to position `to` (the host slots' `move_position`).
    pub(super) fn move_position(&mut self, from: usize, to: usize) -> Result<()> {
        if from < self.len && to < self.stride {
            for t in [&self.k, &self.v] {
                t.slice_set(&t.narrow(1, from, 1)?.copy()?, 1, to)?;
            }
        }
        Ok(())
    }

    /// A copy holding positions `0..n`, allocating at least the first stride and at most `cap`.
    pub(super) fn head_rows(&self, shape: AttnShape, n: usize, cap: usize) -> Result<Option<Self>> {
        if self.len < n {
            return Ok(None);
        }
        let mut out = Self::new(shape, self.k.dtype(), self.k.device(), n.max(FIRST_STRIDE).min(cap.max(n)))?;
        out.copy_rows(self, 0, n)?;
        out.len = n;
        Ok(Some(out))
    }

    /// Position `pos` of `src` into this slot, which holds every position before it.
    pub(super) fn copy_position(&mut self, src: &Self, shape: AttnShape, cap: usize, pos: usize) -> Result<()> {
        if pos >= src.len || pos > self.len {
            return Err(Error::Internal(format!("cannot copy KV position {pos} between these slots")));
        }
        self.reserve(shape, pos + 1, cap)?;
        self.copy_rows(src, pos, 1)?;
        self.len = self.len.max(pos + 1);
        Ok(())
    }

    /// The same rows in a host slot (the prompt cache's files are written from host slots).
    pub(super) fn to_host(&self) -> Result<SlotBuf> {
        let (k, v) = (self.k.flatten_all()?, self.v.flatten_all()?);
        let (base, len, stride) = (0, self.len, self.stride);
        Ok(match self.k.dtype() {
            DType::F32 => {
                let (k, v) = (k.to_vec1()?, v.to_vec1()?);
                let meta = vec![(); self.k.dims()[0] * stride];
                SlotBuf::F32(Slot { k, v, k_meta: meta.clone(), v_meta: meta, base, len, stride })
            }
            _ => {
                let (k, v) = (k.to_dtype(DType::F16)?.to_vec1()?, v.to_dtype(DType::F16)?.to_vec1()?);
                let meta = vec![(); self.k.dims()[0] * stride];
                SlotBuf::F16(Slot { k, v, k_meta: meta.clone(), v_meta: meta, base, len, stride })
            }
        })
    }
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
                let stride = FIRST_STRIDE.min(self.capacity.max(1));
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
            let stride = (pos + n).max(FIRST_STRIDE).min(cap);
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
