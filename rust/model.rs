//! The looped transformer (DESIGN section 1): embeddings, optional unshared prelude layers, a block of k layers
//! applied `loops` times, a shared final norm and head (tied to the embeddings unless `output.weight` exists).
//!
//! Every forward call takes a batch of sequence chunks: the linear layers see all rows at once, attention runs per
//! sequence over its own cache. The loop range is explicit so a caller can run loops `d..L` on hidden states that a
//! depth-`d` pass produced (the prefix property the speculative modes rely on).

use std::collections::HashMap;
use std::ops::Range;

use std::sync::Arc;

use candle_core::quantized::ggml_file::qtensor_from_ggml;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;

use crate::draft_head::DraftHead;
use crate::error::{Error, Result};
use crate::kv::{AttnShape, KvCache, KvKind, RowLayout};
use crate::linear::Linear;
use crate::loader::{Config, ModelFile, MAX_LOOPS};

struct Layer {
    attn_norm: Vec<f32>,
    wq: Linear,
    wk: Linear,
    wv: Linear,
    wo: Linear,
    ffn_norm: Vec<f32>,
    gate: Linear,
    up: Linear,
    down: Linear,
}

pub struct Model {
    pub cfg: Config,
    embd: Linear,
    head: Linear,
    /// The head over the file's draft vocabulary, for speculative drafts (used while `use_draft_head`).
    draft_head: Option<DraftHead>,
    use_draft_head: bool,
    output_norm: Tensor,
    prelude: Vec<Layer>,
    block: Vec<Layer>,
    /// RoPE inverse frequencies θ^(-2i/d), i < head_dim/2, in f64 so angles at large positions stay exact.
    inv_freq: Vec<f64>,
    /// (cos, sin) of pos·θ_i for positions below `len / (head_dim / 2)`, `[pos][i]`, grown on demand up to
    /// `ROPE_TABLE_MAX` positions: every layer of every loop rotates the same positions, and computing the angles
    /// anew took 3–4% of a prefill.
    rope_table: std::sync::RwLock<Vec<(f32, f32)>>,
    kv_kind: KvKind,
}

/// New tokens of one sequence: written at positions `pos..pos+tokens.len()` of `cache`, or laid out as a tree.
pub struct SeqChunk<'a> {
    pub cache: &'a mut KvCache,
    pub pos: usize,
    pub tokens: &'a [u32],
    /// Tree rows (speculative verification): where each row is stored, what it sees, its RoPE position.
    pub tree: Option<&'a TreeRows>,
}

/// Rows of a token tree: row i is stored at `store[i]`, attends to `0..prefix[i]` and `extra[i]`, and is rotated
/// for position `rope[i]` (its depth), so a node computes exactly what it would as the next token of its path.
#[derive(Debug, Clone, Default)]
pub struct TreeRows {
    pub store: Vec<usize>,
    pub prefix: Vec<usize>,
    pub extra: Vec<Vec<usize>>,
    pub rope: Vec<usize>,
}

/// Rows of one sequence on their way through loops `loops` (see `Model::run_blocks`); `x` holds their hidden
/// states, `(seq.tokens.len(), dim)`, and is replaced by the output.
pub struct RowBlock<'a> {
    pub seq: SeqChunk<'a>,
    pub x: Tensor,
    pub loops: Range<usize>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitRows {
    /// Only each sequence's last row: `(n_seqs, vocab)`.
    Last,
    /// Every row of every sequence, in order: `(total_tokens, vocab)`.
    All,
}

/// candle's AVX-512 VNNI kernels for Q8_0 (repacked tiles, for one row and for many) need the output count to be a
/// multiple of 16; the 50,257-row head is not, and would fall back to the generic per-block dot product (several
/// times slower, and most of a decode step). Zero rows pad it; `Model::logits` drops their outputs.
fn pad_rows_for_kernels(t: Arc<QTensor>) -> Result<Arc<QTensor>> {
    const TILE: usize = 16;
    let (rows, cols) = t.shape().dims2()?;
    if t.dtype() != GgmlDType::Q8_0 || rows % TILE == 0 {
        return Ok(t);
    }
    let padded_rows = rows.div_ceil(TILE) * TILE;
    let mut raw = t.data()?.into_owned();
    let row_bytes = raw.len() / rows;
    raw.resize(padded_rows * row_bytes, 0); // all-zero Q8_0 blocks: scale 0, so the padded logits are 0
    Ok(Arc::new(qtensor_from_ggml(GgmlDType::Q8_0, &raw, vec![padded_rows, cols], &Device::Cpu)?))
}

fn take(tensors: &mut HashMap<String, QTensor>, name: &str) -> Result<QTensor> {
    tensors.remove(name).ok_or_else(|| Error::Internal(format!("tensor {name} vanished after validation")))
}

fn matmul(tensors: &mut HashMap<String, QTensor>, name: &str) -> Result<Linear> {
    Linear::new(Arc::new(take(tensors, name)?))
}

fn norm(tensors: &mut HashMap<String, QTensor>, name: &str) -> Result<Tensor> {
    Ok(take(tensors, name)?.dequantize(&Device::Cpu)?.to_dtype(DType::F32)?)
}

impl Layer {
    fn load(t: &mut HashMap<String, QTensor>, p: &str) -> Result<Self> {
        Ok(Self {
            attn_norm: norm(t, &format!("{p}.attn_norm.weight"))?.to_vec1()?,
            wq: matmul(t, &format!("{p}.attn_q.weight"))?,
            wk: matmul(t, &format!("{p}.attn_k.weight"))?,
            wv: matmul(t, &format!("{p}.attn_v.weight"))?,
            wo: matmul(t, &format!("{p}.attn_output.weight"))?,
            ffn_norm: norm(t, &format!("{p}.ffn_norm.weight"))?.to_vec1()?,
            gate: matmul(t, &format!("{p}.ffn_gate.weight"))?,
            up: matmul(t, &format!("{p}.ffn_up.weight"))?,
            down: matmul(t, &format!("{p}.ffn_down.weight"))?,
        })
    }
}

impl Model {
    pub fn new(file: ModelFile) -> Result<Self> {
        let ModelFile { config: cfg, mut tensors, draft_ids, .. } = file;
        let all_f32 = tensors.values().all(|t| t.dtype() == candle_core::quantized::GgmlDType::F32);
        let embd_t = Arc::new(take(&mut tensors, "token_embd.weight")?);
        let head_t = tensors.remove("output.weight").map_or_else(|| embd_t.clone(), Arc::new);
        let head_t = pad_rows_for_kernels(head_t)?;
        let draft_head = draft_ids.map(|ids| DraftHead::new(&head_t, &ids, cfg.vocab_size)).transpose()?;
        let tied = Arc::ptr_eq(&embd_t, &head_t); // tied, and no padding needed: one copy serves both
        let embd = Linear::new(embd_t)?;
        let head = if tied { embd.clone() } else { Linear::new(head_t)? };
        let output_norm = norm(&mut tensors, "output_norm.weight")?;
        let prelude =
            (0..cfg.prelude_count).map(|i| Layer::load(&mut tensors, &format!("pre.{i}"))).collect::<Result<_>>()?;
        let block =
            (0..cfg.block_count).map(|i| Layer::load(&mut tensors, &format!("blk.{i}"))).collect::<Result<_>>()?;
        let half = cfg.head_dim / 2;
        let inv_freq = (0..half).map(|i| (cfg.rope_theta as f64).powf(-2.0 * i as f64 / cfg.head_dim as f64)).collect();
        let kv_kind = if all_f32 { KvKind::F32 } else { KvKind::F16 };
        let use_draft_head = draft_head.is_some();
        Ok(Self {
            cfg,
            embd,
            head,
            draft_head,
            use_draft_head,
            output_norm,
            prelude,
            block,
            inv_freq,
            rope_table: Default::default(),
            kv_kind,
        })
    }

    pub fn kv_kind(&self) -> KvKind {
        self.kv_kind
    }

    /// Store K/V as `kind` in caches made from now on (the "fp16" default is f32 for F32 models, else f16).
    pub fn set_kv_kind(&mut self, kind: KvKind) {
        self.kv_kind = kind;
    }

    /// A fresh cache for one sequence of up to `capacity` positions (memory is touched only as it fills).
    pub fn new_cache(&self, capacity: usize) -> KvCache {
        let shape =
            AttnShape { n_heads: self.cfg.n_heads, n_kv_heads: self.cfg.n_kv_heads, head_dim: self.cfg.head_dim };
        KvCache::new(self.kv_kind, shape, capacity, self.cfg.prelude_count + MAX_LOOPS * self.cfg.block_count)
    }

    /// Cache slot of block layer `layer` in loop `lp` (0-based); prelude layers take the first slots.
    fn slot(&self, lp: usize, layer: usize) -> usize {
        self.cfg.prelude_count + lp * self.cfg.block_count + layer
    }

    /// Token embeddings, `(n, dim)`.
    pub fn embed(&self, tokens: &[u32]) -> Result<Tensor> {
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
            return Err(Error::InvalidArgument(format!(
                "token id {bad} is outside the {}-token vocabulary",
                self.cfg.vocab_size
            )));
        }
        self.embd.rows(tokens)
    }

    /// Run the prelude (when `with_prelude`) and then block loops `loops` over `x` (rows of all `seqs`, in order).
    pub fn run(&self, mut x: Tensor, seqs: &mut [SeqChunk], with_prelude: bool, loops: Range<usize>) -> Result<Tensor> {
        if loops.end > MAX_LOOPS {
            return Err(Error::InvalidArgument(format!("loops must be at most {MAX_LOOPS}, got {}", loops.end)));
        }
        if with_prelude {
            x = self.prelude_pass(x, seqs)?;
        }
        for lp in loops {
            x = self.loop_pass(x, seqs, lp)?;
        }
        Ok(x)
    }

    fn prelude_pass(&self, x: Tensor, seqs: &mut [SeqChunk]) -> Result<Tensor> {
        self.prelude.iter().enumerate().try_fold(x, |x, (i, layer)| self.layer_forward(layer, &x, seqs, i))
    }

    /// The shared block once, as loop `lp` (0-based).
    fn loop_pass(&self, x: Tensor, seqs: &mut [SeqChunk], lp: usize) -> Result<Tensor> {
        self.block.iter().enumerate().try_fold(x, |x, (j, layer)| self.layer_forward(layer, &x, seqs, self.slot(lp, j)))
    }

    /// Advance several sequences' rows, each through its own loop range, in shared passes: every loop runs once,
    /// over the rows of all blocks whose range holds it (the prelude first, for blocks starting at loop 0). This is
    /// how a speculative draft or verification shares its weight reads with plain rows of other sequences.
    pub fn run_blocks(&self, blocks: &mut [RowBlock]) -> Result<()> {
        let (Some(first), Some(last)) =
            (blocks.iter().map(|b| b.loops.start).min(), blocks.iter().map(|b| b.loops.end).max())
        else {
            return Ok(());
        };
        if last > MAX_LOOPS {
            return Err(Error::InvalidArgument(format!("loops must be at most {MAX_LOOPS}, got {last}")));
        }
        if !self.prelude.is_empty() {
            self.advance(blocks, |b| b.loops.start == 0, |x, seqs| self.prelude_pass(x, seqs))?;
        }
        for lp in first..last {
            self.advance(blocks, |b| b.loops.contains(&lp), |x, seqs| self.loop_pass(x, seqs, lp))?;
        }
        Ok(())
    }

    /// Apply `f` to the stacked rows of the blocks `take` selects, and split the result back into them.
    fn advance(
        &self,
        blocks: &mut [RowBlock],
        take: impl Fn(&RowBlock) -> bool,
        f: impl FnOnce(Tensor, &mut [SeqChunk]) -> Result<Tensor>,
    ) -> Result<()> {
        let chosen: Vec<&mut RowBlock> = blocks.iter_mut().filter(|b| take(b)).collect();
        if chosen.is_empty() {
            return Ok(());
        }
        let xs: Vec<&Tensor> = chosen.iter().map(|b| &b.x).collect();
        let x = if xs.len() == 1 { xs[0].clone() } else { Tensor::cat(&xs, 0)? };
        let mut rows = Vec::with_capacity(chosen.len());
        let mut seqs: Vec<SeqChunk> = chosen
            .into_iter()
            .map(|RowBlock { seq, x, .. }| {
                rows.push((seq.tokens.len(), x));
                SeqChunk { cache: &mut *seq.cache, pos: seq.pos, tokens: seq.tokens, tree: seq.tree }
            })
            .collect();
        let y = f(x, &mut seqs)?;
        drop(seqs);
        let mut off = 0;
        for (n, x) in rows {
            *x = y.narrow(0, off, n)?;
            off += n;
        }
        Ok(())
    }

    /// Tokens drafts may propose through the draft head (0 when drafts use the full head).
    pub fn draft_vocab_len_in_use(&self) -> usize {
        match &self.draft_head {
            Some(d) if self.use_draft_head => d.len(),
            _ => 0,
        }
    }

    /// Draft with the file's draft vocabulary (the default when it lists one) or with the full head.
    pub fn set_use_draft_head(&mut self, on: bool) {
        self.use_draft_head = on && self.draft_head.is_some();
    }

    /// Logit rows for speculative drafts: the draft head's (−∞ outside its vocabulary) when in use, else the full
    /// head's. Never used to choose an output token.
    pub fn draft_logits(&self, h: &Tensor) -> Result<Vec<Vec<f32>>> {
        match &self.draft_head {
            Some(d) if self.use_draft_head => d.logits(&self.final_norm(h)?, self.cfg.vocab_size),
            _ => Ok(self.logits(h)?.to_vec2::<f32>()?),
        }
    }

    fn final_norm(&self, h: &Tensor) -> Result<Tensor> {
        Ok(candle_nn::ops::rms_norm(h, &self.output_norm, self.cfg.rms_eps as f32)?)
    }

    /// Final norm and head: `(n, dim)` hidden states to `(n, vocab)` logits.
    pub fn logits(&self, h: &Tensor) -> Result<Tensor> {
        let h = self.final_norm(h)?;
        let logits = self.head.forward(&h)?.to_dtype(DType::F32)?;
        match logits.dim(candle_core::D::Minus1)? {
            n if n == self.cfg.vocab_size => Ok(logits),
            _ => Ok(logits.narrow(candle_core::D::Minus1, 0, self.cfg.vocab_size)?.contiguous()?),
        }
    }

    /// The whole model at depth `loops` over new tokens of each sequence, returning logits.
    pub fn forward(&self, seqs: &mut [SeqChunk], loops: usize, rows: LogitRows) -> Result<Tensor> {
        if loops == 0 || loops > MAX_LOOPS {
            return Err(Error::InvalidArgument(format!("loops must be in 1..={MAX_LOOPS}, got {loops}")));
        }
        let tokens: Vec<u32> = seqs.iter().flat_map(|s| s.tokens.iter().copied()).collect();
        if tokens.is_empty() || seqs.iter().any(|s| s.tokens.is_empty()) {
            return Err(Error::InvalidArgument("forward needs at least one token per sequence".into()));
        }
        let x = self.embed(&tokens)?;
        let h = self.run(x, seqs, true, 0..loops)?;
        let h = match rows {
            LogitRows::All => h,
            LogitRows::Last => {
                let mut ends = Vec::with_capacity(seqs.len());
                let mut off = 0u32;
                for s in seqs.iter() {
                    off += s.tokens.len() as u32;
                    ends.push(off - 1);
                }
                h.index_select(&Tensor::new(ends.as_slice(), &Device::Cpu)?, 0)?
            }
        };
        self.logits(&h)
    }

    /// One layer over the rows of every sequence. Norms, residuals and the SwiGLU gate run here on plain rows (a
    /// pool round trip per element-wise op would cost more than the op at decode sizes); matmuls in `Linear`.
    fn layer_forward(&self, l: &Layer, x: &Tensor, seqs: &mut [SeqChunk], slot: usize) -> Result<Tensor> {
        let eps = self.cfg.rms_eps;
        let (hd, nh, nkv, dim) = (self.cfg.head_dim, self.cfg.n_heads, self.cfg.n_kv_heads, self.cfg.dim);
        let n = x.dim(0)?;
        let mut xs = x.flatten_all()?.to_vec1::<f32>()?; // (n, dim), the residual stream
        let h = rms_norm(&xs, &l.attn_norm, eps);
        let mut q = l.wq.forward_rows(&h, n)?; // (n, nh*hd)
        let mut k = l.wk.forward_rows(&h, n)?; // (n, nkv*hd)
        let v = l.wv.forward_rows(&h, n)?; // (n, nkv*hd)
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
            self.rope(&mut q[row * nh * hd..(row + n) * nh * hd], nh, positions);
            self.rope(&mut k[row * nkv * hd..(row + n) * nkv * hd], nkv, positions);
            row += n;
        }
        // Each sequence attends over its own cache; several sequences (a batched decode step) spread over the pool
        // when there is enough work (a pool round trip per layer costs more than short contexts' attention).
        let mut jobs = Vec::with_capacity(seqs.len());
        let (mut row, mut rest) = (0, att.as_mut_slice());
        for s in seqs.iter_mut() {
            let n = s.tokens.len();
            let (o, tail) = rest.split_at_mut(n * nh * hd);
            rest = tail;
            let kr = row * nkv * hd..(row + n) * nkv * hd;
            jobs.push((s, &q[row * nh * hd..(row + n) * nh * hd], &k[kr.clone()], &v[kr], o));
            row += n;
        }
        let attend = |(s, qq, kk, vv, o): (&mut SeqChunk<'_>, &[f32], &[f32], &[f32], &mut [f32])| match s.tree {
            Some(t) => {
                let layout = RowLayout { store: &t.store, prefix: &t.prefix, extra: &t.extra, pos: &t.rope };
                s.cache.write_rows_and_attend(slot, &layout, kk, vv, qq, o)
            }
            None => s.cache.write_and_attend(slot, s.pos, kk, vv, qq, o),
        };
        let work: usize = seqs_work(&jobs, nh * hd);
        if jobs.len() > 1 && work >= 1 << 16 {
            jobs.into_par_iter().try_for_each(attend)?;
        } else {
            jobs.into_iter().try_for_each(attend)?;
        }
        add_assign(&mut xs, &l.wo.forward_rows(&att, n)?);
        let h = rms_norm(&xs, &l.ffn_norm, eps);
        let mut m = l.gate.forward_rows(&h, n)?;
        let up = l.up.forward_rows(&h, n)?;
        crate::simd::silu_mul(&mut m, &up);
        add_assign(&mut xs, &l.down.forward_rows(&m, n)?);
        Ok(Tensor::from_vec(xs, (n, dim), &Device::Cpu)?)
    }

    /// Rotate adjacent pairs (x[2i], x[2i+1]) of every head by pos·θ_i (llama.cpp's "norm" RoPE), row r at
    /// `positions[r]`.
    fn rope(&self, x: &mut [f32], heads: usize, positions: &[usize]) {
        rope_rows(x, heads, self.cfg.head_dim, positions, &self.inv_freq, &self.rope_table);
    }
}

/// `Model::rope` over a table of angles shared by calls (`rope_table`).
fn rope_rows(
    x: &mut [f32],
    heads: usize,
    hd: usize,
    positions: &[usize],
    inv_freq: &[f64],
    rope_table: &std::sync::RwLock<Vec<(f32, f32)>>,
) {
    let half = inv_freq.len();
    let angles = |p: usize| inv_freq.iter().map(move |f| ((p as f64 * f).cos() as f32, (p as f64 * f).sin() as f32));
    let needed = positions.iter().max().map_or(0, |&p| p + 1).min(ROPE_TABLE_MAX);
    if rope_table.read().unwrap_or_else(|e| e.into_inner()).len() < needed * half {
        let mut t = rope_table.write().unwrap_or_else(|e| e.into_inner());
        let (from, to) = (t.len() / half, needed.max(2 * t.len() / half).min(ROPE_TABLE_MAX));
        for p in from..to {
            t.extend(angles(p));
        }
    }
    let table = rope_table.read().unwrap_or_else(|e| e.into_inner());
    let mut far = Vec::new();
    for (row, &pos) in x.chunks_exact_mut(heads * hd).zip(positions) {
        // Positions past the table (a sliding-window stream's absolute positions can grow without bound) get
        // their angles computed in place, by the same formula.
        let cs = if pos < ROPE_TABLE_MAX {
            &table[pos * half..(pos + 1) * half]
        } else {
            far.clear();
            far.extend(angles(pos));
            far.as_slice()
        };
        for head in row.chunks_exact_mut(hd) {
            for (pair, &(c, s)) in head.chunks_exact_mut(2).zip(cs) {
                let (a, b) = (pair[0], pair[1]);
                pair[0] = a * c - b * s;
                pair[1] = a * s + b * c;
            }
        }
    }
}

/// Positions whose RoPE angles `Model::rope` keeps (the table grows with the longest context seen, up to 16 MB at
/// head_dim 64 and 32 MB at 128).
const ROPE_TABLE_MAX: usize = 1 << 16;

/// Query-key products of a layer's attention: rows × positions they see × query width, summed over sequences.
fn seqs_work(jobs: &[(&mut SeqChunk, &[f32], &[f32], &[f32], &mut [f32])], width: usize) -> usize {
    jobs.iter().map(|(s, ..)| s.tokens.len() * (s.pos + s.tokens.len()) * width).sum()
}

/// RMSNorm of each `w.len()`-wide row, as ggml computes it: the mean square summed in f64, then
/// `x · (1 / √(mean + ε)) · w` in f32.
fn rms_norm(x: &[f32], w: &[f32], eps: f64) -> Vec<f32> {
    let d = w.len();
    let mut out = vec![0f32; x.len()];
    for (o, row) in out.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
        let mean = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / d as f64;
        let scale = (1.0 / (mean + eps).sqrt()) as f32;
        o.iter_mut().zip(row).zip(w).for_each(|((o, &v), &g)| *o = v * scale * g);
    }
    out
}

fn add_assign(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_from_the_table_and_past_it_is_the_direct_rotation() {
        let (heads, hd) = (2, 8);
        let inv_freq: Vec<f64> = (0..hd / 2).map(|i| 10000f64.powf(-2.0 * i as f64 / hd as f64)).collect();
        let positions = [0, 5, 65_535, 65_536, 70_000, 5];
        let x0: Vec<f32> = (0..positions.len() * heads * hd).map(|i| (i as f32 * 0.37).sin()).collect();
        let table = std::sync::RwLock::default();
        let mut x = x0.clone();
        rope_rows(&mut x, heads, hd, &positions, &inv_freq, &table);
        assert_eq!(table.read().unwrap().len(), ROPE_TABLE_MAX * hd / 2, "the table stops at ROPE_TABLE_MAX");
        for (r, &p) in positions.iter().enumerate() {
            for h in 0..heads {
                for i in 0..hd / 2 {
                    let at = (r * heads + h) * hd + 2 * i;
                    let (c, s) = ((p as f64 * inv_freq[i]).cos() as f32, (p as f64 * inv_freq[i]).sin() as f32);
                    let (a, b) = (x0[at], x0[at + 1]);
                    assert_eq!((x[at], x[at + 1]), (a * c - b * s, a * s + b * c), "position {p}, pair {i}");
                }
            }
        }
    }
}
