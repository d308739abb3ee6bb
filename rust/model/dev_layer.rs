//! One transformer layer on a candle device (`Compute::Device`): the same function as `layer.rs`, as tensor ops —
//! candle-nn's RMSNorm, softmax and interleaved RoPE kernels, the weight products of `DevWeight`, attention over each
//! sequence's K/V slot in device memory (`KvCache::attend_on_device`). The residual stream stays f32.

use std::collections::HashMap;

use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};

use super::config::Config;
use super::layer::{norm, take, Layer};
use super::linear::DevWeight;
use super::rope::Rope;
use super::rows::SeqChunk;
use crate::error::{Error, Result};
use crate::profile::{self, Stage};

/// A layer where the model computes: the CPU engine's (`layer.rs`) or a device's.
pub(super) enum AnyLayer {
    Host(Layer),
    Device(DevLayer),
}

impl AnyLayer {
    pub(super) fn forward(
        &self,
        cfg: &Config,
        rope: &Rope,
        x: &Tensor,
        seqs: &mut [SeqChunk],
        slot: usize,
    ) -> Result<Tensor> {
        match self {
            Self::Host(l) => l.forward(cfg, rope, x, seqs, slot),
            Self::Device(l) => l.forward(cfg, rope, x, seqs, slot),
        }
    }

    pub(super) fn own_kernels(&self) -> bool {
        matches!(self, Self::Host(l) if l.own_kernels())
    }
}

pub(super) struct DevLayer {
    attn_norm: Tensor,
    wq: DevWeight,
    wk: DevWeight,
    wv: DevWeight,
    bias: Option<[Tensor; 3]>,
    wo: DevWeight,
    ffn_norm: Tensor,
    post_norms: Option<[Tensor; 2]>,
    gate: DevWeight,
    up: DevWeight,
    down: DevWeight,
}

impl DevLayer {
    pub(super) fn load(t: &mut HashMap<String, QTensor>, p: &str, cfg: &Config, device: &Device) -> Result<Self> {
        let mut vector = |name: &str| -> Result<Tensor> { Ok(norm(t, &format!("{p}.{name}"))?.to_device(device)?) };
        let bias = match cfg.attn_bias {
            true => Some([vector("attn_q.bias")?, vector("attn_k.bias")?, vector("attn_v.bias")?]),
            false => None,
        };
        let post_norms = match cfg.post_norms {
            true => Some([vector("attn_post_norm.weight")?, vector("ffn_post_norm.weight")?]),
            false => None,
        };
        let (attn_norm, ffn_norm) = (vector("attn_norm.weight")?, vector("ffn_norm.weight")?);
        let mut weight = |name: &str| DevWeight::new(&take(t, &format!("{p}.{name}.weight"))?, device);
        Ok(Self {
            attn_norm,
            wq: weight("attn_q")?,
            wk: weight("attn_k")?,
            wv: weight("attn_v")?,
            bias,
            wo: weight("attn_output")?,
            ffn_norm,
            post_norms,
            gate: weight("ffn_gate")?,
            up: weight("ffn_up")?,
            down: weight("ffn_down")?,
        })
    }

    /// `layer.rs`'s `Layer::forward` on the device: `x (n, dim)` f32 rows of all `seqs`, in order.
    fn forward(&self, cfg: &Config, rope: &Rope, x: &Tensor, seqs: &mut [SeqChunk], slot: usize) -> Result<Tensor> {
        let eps = cfg.rms_eps as f32;
        let h = candle_nn::ops::rms_norm(x, &self.attn_norm, eps)?;
        let att = self.attention(cfg, rope, &h, seqs, slot)?;
        let att = product(&self.wo, &att)?;
        let x = (x + self.post_norm(0, att, eps)?)?;
        let h = candle_nn::ops::rms_norm(&x, &self.ffn_norm, eps)?;
        let m = (candle_nn::ops::silu(&product(&self.gate, &h)?)? * product(&self.up, &h)?)?;
        let m = product(&self.down, &m)?;
        Ok((x + self.post_norm(1, m, eps)?)?)
    }

    fn post_norm(&self, which: usize, y: Tensor, eps: f32) -> Result<Tensor> {
        match &self.post_norms {
            Some(norms) => Ok(candle_nn::ops::rms_norm(&y, &norms[which], eps)?),
            None => Ok(y),
        }
    }

    /// Q, K, V of the normed rows `h (n, dim)`, rotated for their positions; each sequence's K/V written to its
    /// slot `slot` and its rows' attention over it; the output, `(n, n_heads·head_dim)`.
    fn attention(&self, cfg: &Config, rope: &Rope, h: &Tensor, seqs: &mut [SeqChunk], slot: usize) -> Result<Tensor> {
        let (mut q, mut k, mut v) = (product(&self.wq, h)?, product(&self.wk, h)?, product(&self.wv, h)?);
        if let Some([bq, bk, bv]) = &self.bias {
            (q, k, v) = (q.broadcast_add(bq)?, k.broadcast_add(bk)?, v.broadcast_add(bv)?);
        }
        profile::time(Stage::Attention, || {
            let positions: Vec<u32> =
                seqs.iter().flat_map(|s| (s.pos..s.pos + s.tokens.len()).map(|p| p as u32)).collect();
            let (q, k) = rope.rotate((&q, cfg.n_heads), (&k, cfg.n_kv_heads), &positions)?;
            let mut outs = Vec::with_capacity(seqs.len());
            let mut row = 0;
            for s in seqs.iter_mut() {
                if s.tree.is_some() {
                    return Err(Error::Internal("tree rows reached a device layer".into()));
                }
                let n = s.tokens.len();
                let (qs, ks, vs) = (q.narrow(0, row, n)?, k.narrow(0, row, n)?, v.narrow(0, row, n)?);
                let fills = super::layer::exit_fills(cfg, slot, s.exits.unwrap_or(&[]));
                outs.push(s.cache.attend_on_device(slot, s.pos, &ks, &vs, &qs, &fills)?);
                row += n;
            }
            Ok(if outs.len() == 1 { outs.swap_remove(0) } else { Tensor::cat(&outs, 0)? })
        })
    }
}

/// `x · Wᵀ` on the device, timed as the layers' weight products.
fn product(w: &DevWeight, x: &Tensor) -> Result<Tensor> {
    profile::time(Stage::Matmul, || w.forward(x))
}
