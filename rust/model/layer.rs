//! One transformer layer (pre-norm attention and SwiGLU feed-forward) over the rows of a batch of sequences.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;

use super::config::Config;
use super::linear::{Group, Linear};
use super::norm::rms_norm;
use super::rope::Rope;
use super::rows::SeqChunk;
use crate::error::{Error, Result};
use crate::kernels::simd::silu_mul;
use crate::kv::RowLayout;
use crate::limits::ATTN_PARALLEL_MIN;
use crate::profile::{self, Stage};

pub(super) struct Layer {
    attn_norm: Vec<f32>,
    /// Q, K, V.
    qkv: Group,
    /// Q, K and V biases, when the file has them (Qwen2's layers).
    bias: Option<[Vec<f32>; 3]>,
    wo: Linear,
    ffn_norm: Vec<f32>,
    /// Norms of the attention and feed-forward outputs before the residual adds, when the file has them.
    post_norms: Option<[Vec<f32>; 2]>,
    /// Gate, up.
    gate_up: Group,
    down: Linear,
}

pub(super) fn take(tensors: &mut HashMap<String, QTensor>, name: &str) -> Result<QTensor> {
    tensors.remove(name).ok_or_else(|| Error::Internal(format!("tensor {name} vanished after validation")))
}

fn matmul(tensors: &mut HashMap<String, QTensor>, name: &str) -> Result<Linear> {
    Linear::new(Arc::new(take(tensors, name)?))
}

/// Layer `p`'s weights `names` (which multiply the same input) as one group.
fn group<const N: usize>(tensors: &mut HashMap<String, QTensor>, p: &str, names: [&str; N]) -> Result<Group> {
    Group::new(names.iter().map(|n| take(tensors, &format!("{p}.{n}.weight"))).collect::<Result<_>>()?)
}

pub(super) fn norm(tensors: &mut HashMap<String, QTensor>, name: &str) -> Result<Tensor> {
    Ok(take(tensors, name)?.dequantize(&Device::Cpu)?.to_dtype(DType::F32)?)
}

impl Layer {
    pub(super) fn load(t: &mut HashMap<String, QTensor>, p: &str, cfg: &Config) -> Result<Self> {
        let bias = match cfg.attn_bias {
            true => Some([
                norm(t, &format!("{p}.attn_q.bias"))?.to_vec1()?,
                norm(t, &format!("{p}.attn_k.bias"))?.to_vec1()?,
                norm(t, &format!("{p}.attn_v.bias"))?.to_vec1()?,
            ]),
            false => None,
        };
        let post_norms = match cfg.post_norms {
            true => Some([
                norm(t, &format!("{p}.attn_post_norm.weight"))?.to_vec1()?,
                norm(t, &format!("{p}.ffn_post_norm.weight"))?.to_vec1()?,
            ]),
            false => None,
        };
        Ok(Self {
            bias,
            post_norms,
            attn_norm: norm(t, &format!("{p}.attn_norm.weight"))?.to_vec1()?,
            qkv: group(t, p, ["attn_q", "attn_k", "attn_v"])?,
            wo: matmul(t, &format!("{p}.attn_output.weight"))?,
            ffn_norm: norm(t, &format!("{p}.ffn_norm.weight"))?.to_vec1()?,
            gate_up: group(t, p, ["ffn_gate", "ffn_up"])?,
            down: matmul(t, &format!("{p}.ffn_down.weight"))?,
        })
    }

    /// Whether every weight product runs tinyloop's own kernels (each row's output independent of the rows beside
    /// it, and run on the calling thread below `PARALLEL_MIN`).
    pub(super) fn own_kernels(&self) -> bool {
        self.qkv.own_kernels()
            && self.gate_up.own_kernels()
            && [&self.wo, &self.down].iter().all(|w| matches!(w, Linear::Own(_)))
    }

    /// This layer over the rows of every sequence. Norms, residuals and the SwiGLU gate run here on plain rows (a
    /// pool round trip per element-wise op would cost more than the op at decode sizes); matmuls in `Linear`.
    pub(super) fn forward(
        &self,
        cfg: &Config,
        rope: &Rope,
        x: &Tensor,
        seqs: &mut [SeqChunk],
        slot: usize,
    ) -> Result<Tensor> {
        let n = x.dim(0)?;
        let mut xs = x.flatten_all()?.to_vec1::<f32>()?; // (n, dim), the residual stream
        let h = rms_norm(&xs, &self.attn_norm, cfg.rms_eps);
        let att = self.attention(cfg, rope, &h, n, seqs, slot)?;
        let att = product(&self.wo, &att, n)?;
        add_assign(&mut xs, &self.post_norm(0, att, cfg));
        let h = rms_norm(&xs, &self.ffn_norm, cfg.rms_eps);
        let [mut m, up]: [Vec<f32>; 2] = products(&self.gate_up, &h, n)?;
        silu_mul(&mut m, &up);
        let m = product(&self.down, &m, n)?;
        add_assign(&mut xs, &self.post_norm(1, m, cfg));
        Ok(Tensor::from_vec(xs, (n, cfg.dim), &Device::Cpu)?)
    }

    /// A sublayer's output (`which`: 0 attention, 1 feed-forward) as it is added to the residual stream: normed by
    /// the layer's post-norm when it has them.
    fn post_norm(&self, which: usize, y: Vec<f32>, cfg: &Config) -> Vec<f32> {
        match &self.post_norms {
            Some(norms) => rms_norm(&y, &norms[which], cfg.rms_eps),
            None => y,
        }
    }

    /// Q, K, V of the `n` normed rows `h`, rotated for their positions; K/V written to each sequence's cache slot
    /// `slot`; the attention output, `(n, n_heads·head_dim)`.
    fn attention(
        &self,
        cfg: &Config,
        rope: &Rope,
        h: &[f32],
        n: usize,
        seqs: &mut [SeqChunk],
        slot: usize,
    ) -> Result<Vec<f32>> {
        // (n, nh*hd), (n, nkv*hd), (n, nkv*hd)
        let [mut q, mut k, mut v]: [Vec<f32>; 3] = products(&self.qkv, h, n)?;
        if let Some([bq, bk, bv]) = &self.bias {
            for (x, b) in [(&mut q, bq), (&mut k, bk), (&mut v, bv)] {
                x.chunks_exact_mut(b.len()).for_each(|row| add_assign(row, b));
            }
        }
        profile::time(Stage::Attention, || attend(cfg, rope, (&mut q, &mut k, &v), seqs, slot))
    }
}

/// RoPE over Q and K, then each sequence's K/V written to its cache slot and its attention over the cache; the
/// attention output, `(n, n_heads·head_dim)`.
fn attend(
    cfg: &Config,
    rope: &Rope,
    (q, k, v): (&mut [f32], &mut [f32], &[f32]),
    seqs: &mut [SeqChunk],
    slot: usize,
) -> Result<Vec<f32>> {
    let (hd, nh, nkv) = (cfg.head_dim, cfg.n_heads, cfg.n_kv_heads);
    let mut att = vec![0f32; q.len()];
    let mut row = 0;
    for s in seqs.iter() {
        let n = s.tokens.len();
        let causal: Vec<usize>;
        let positions = match s.tree {
            Some(t) => t.rope.as_slice(),
            None => {
                causal = (s.pos..s.pos + n).collect();
                causal.as_slice()
            }
        };
        rope.apply(&mut q[row * nh * hd..(row + n) * nh * hd], nh, positions);
        rope.apply(&mut k[row * nkv * hd..(row + n) * nkv * hd], nkv, positions);
        row += n;
    }
    // Each sequence attends over its own cache; several sequences (a batched decode step) spread over the pool
    // when there is enough work (a pool round trip per layer costs more than short contexts' attention).
    let mut jobs: Vec<AttnJob> = Vec::with_capacity(seqs.len());
    let (mut row, mut rest) = (0, att.as_mut_slice());
    for s in seqs.iter_mut() {
        let n = s.tokens.len();
        let (o, tail) = rest.split_at_mut(n * nh * hd);
        rest = tail;
        let kr = row * nkv * hd..(row + n) * nkv * hd;
        jobs.push((s, &q[row * nh * hd..(row + n) * nh * hd], &k[kr.clone()], &v[kr], o));
        row += n;
    }
    let one = |(s, qq, kk, vv, o): AttnJob| match (s.tree, s.exits) {
        (Some(t), _) => {
            let layout = RowLayout { store: &t.store, prefix: &t.prefix, extra: &t.extra, pos: &t.rope, fills: &[] };
            s.cache.write_rows_and_attend(slot, &layout, kk, vv, qq, o)
        }
        (None, Some(exits)) => {
            let fills = exit_fills(cfg, slot, exits);
            let store: Vec<usize> = (s.pos..s.pos + exits.len()).collect();
            let visible: Vec<usize> = (s.pos + 1..=s.pos + exits.len()).collect();
            let layout = RowLayout { store: &store, prefix: &visible, extra: &[], pos: &store, fills: &fills };
            s.cache.write_rows_and_attend(slot, &layout, kk, vv, qq, o)
        }
        (None, None) => s.cache.write_and_attend(slot, s.pos, kk, vv, qq, o),
    };
    let work: usize = seqs_work(&jobs, nh * hd);
    if jobs.len() > 1 && work >= ATTN_PARALLEL_MIN {
        jobs.into_par_iter().try_for_each(one)?;
    } else {
        jobs.into_iter().try_for_each(one)?;
    }
    Ok(att)
}

/// The rows of a chunk that stopped looping before the loop `slot` belongs to, each with the slot of the same layer
/// in its exit loop (adaptive depth: their K/V there is that loop's).
pub(super) fn exit_fills(cfg: &Config, slot: usize, exits: &[usize]) -> Vec<(usize, usize)> {
    let (prelude, block) = (cfg.prelude_count, cfg.block_count);
    if slot < prelude {
        return Vec::new();
    }
    let (lp, j) = ((slot - prelude) / block, (slot - prelude) % block);
    exits.iter().enumerate().filter(|&(_, &e)| e <= lp).map(|(i, &e)| (i, prelude + (e - 1) * block + j)).collect()
}

/// One sequence's share of a layer's attention: its chunk, its Q, K and V rows, and its piece of the output.
type AttnJob<'s, 'a> = (&'s mut SeqChunk<'a>, &'s [f32], &'s [f32], &'s [f32], &'s mut [f32]);

/// Query-key products of a layer's attention: rows × positions they see × query width, summed over sequences.
fn seqs_work(jobs: &[AttnJob], width: usize) -> usize {
    jobs.iter().map(|(s, ..)| s.tokens.len() * (s.pos + s.tokens.len()) * width).sum()
}

/// `x · Wᵀ` for the `n` rows of `x`, timed as the layers' weight products.
fn product(w: &Linear, x: &[f32], n: usize) -> Result<Vec<f32>> {
    profile::time(Stage::Matmul, || w.forward_rows(x, n))
}

/// A group's products for the `n` rows of `x`, timed as the layers' weight products.
fn products<const N: usize>(g: &Group, x: &[f32], n: usize) -> Result<[Vec<f32>; N]> {
    let outs = profile::time(Stage::Matmul, || g.forward_rows(x, n))?;
    outs.try_into().map_err(|_| Error::Internal("a weight group's size".into()))
}

fn add_assign(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}
