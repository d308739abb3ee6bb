//! One KV slot in device memory (`device.rs` says how a device cache uses them): K and V as tensors
//! `(n_kv_heads, stride, head_dim)`, the host slots' `[kv_head][stride][head_dim]` layout, grown like them
//! (`stride.rs`) and written in place (`Tensor::slice_set`).

use candle_core::{DType, Device, Tensor};

use super::stride::next_stride;
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

impl DevSlot {
    pub(super) fn new(shape: AttnShape, dtype: DType, device: &Device, stride: usize) -> Result<Self> {
        let dims = (shape.n_kv_heads, stride, shape.head_dim);
        let (k, v) = (Tensor::zeros(dims, dtype, device)?, Tensor::zeros(dims, dtype, device)?);
        Ok(Self { k, v, base: 0, len: 0, stride })
    }

    /// Make room for positions `0..need`: at least double the stride, up to `cap`.
    fn reserve(&mut self, shape: AttnShape, need: usize, cap: usize) -> Result<()> {
        if need <= self.stride {
            return Ok(());
        }
        let stride = next_stride(self.stride, need, cap);
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
    pub(super) fn write(&mut self, shape: AttnShape, cap: usize, pos: usize, k: &Tensor, v: &Tensor) -> Result<()> {
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
    pub(super) fn attend(&self, shape: AttnShape, pos: usize, q: &Tensor) -> Result<Tensor> {
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
        let mut out = Self::new(shape, self.k.dtype(), self.k.device(), next_stride(0, n, cap))?;
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
}
