//! The looped transformer (docs/architecture.md): embeddings, optional unshared prelude layers, a block of k layers
//! applied `loops` times, a shared final norm and head (tied to the embeddings unless `output.weight` exists).
//!
//! Every forward call takes a batch of sequence chunks: the linear layers see all rows at once, attention runs per
//! sequence over its own cache. The loop range is explicit so a caller can run loops `d..L` on hidden states that a
//! depth-`d` pass produced (the prefix property the speculative modes rely on).
//!
//! The model computes where its `Compute` says: on the CPU engine's own kernels (`layer.rs`), or on a candle device
//! (`dev_layer.rs`), where weights, hidden states and the KV cache stay in device memory. Either way the embedding
//! lookup runs on the host (its rows are uploaded) and logits come back to the host for the sampler.

mod compute;
mod config;
mod depth;
mod dev_layer;
mod exit;
mod layer;
mod linear;
mod norm;
mod rope;
mod row_head;
mod rows;

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use candle_core::quantized::ggml_file::qtensor_from_ggml;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};

pub use compute::{Compute, DEVICE_NAMES};
pub use config::{Config, RopeScaling};
pub use depth::AutoDepth;
use dev_layer::{AnyLayer, DevLayer};
use layer::{norm, take, Layer};
pub use linear::Linear;
use rope::Rope;
pub use row_head::HeadRows;
use row_head::RowHead;
pub use rows::{LogitRows, RowBlock, SeqChunk, TreeRows};

use crate::error::Result;
use crate::kernels::{team, AttnShape};
use crate::kv::{KvCache, KvKind};
use crate::limits::{MAX_LOOPS, SPLIT_MAX_BYTES};
use crate::profile::{self, Stage};

pub struct Model {
    pub cfg: Config,
    embd: Linear,
    head: Linear,
    /// The head over the file's draft vocabulary, for speculative drafts (used while `use_draft_head`).
    draft_head: Option<RowHead>,
    /// The head over the file's exit vocabulary, for the settling rule's checks (`exit.rs`).
    exit_head: Option<RowHead>,
    use_draft_head: bool,
    /// The early-exit gate (`exit_gate.weight` as `(dim, 1)`, `exit_gate.bias`), when the file has one.
    exit_gate: Option<(Tensor, f32)>,
    output_norm: Tensor,
    prelude: Vec<AnyLayer>,
    block: Vec<AnyLayer>,
    compute: Compute,
    rope: Rope,
    kv_kind: KvKind,
    /// Whether caches share one slot per block layer across loops after the prompt (`kv_share = "last"`).
    kv_share: bool,
    /// Whether `run_blocks` runs a batch's sequences in one group per thread (see there).
    split_batches: bool,
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

impl Model {
    /// The model of shape `cfg` over the loader's checked `tensors`; `rows` lists the draft and exit vocabularies,
    /// if any.
    pub fn new(cfg: Config, tensors: HashMap<String, QTensor>, rows: HeadRows) -> Result<Self> {
        Self::on(cfg, tensors, rows, Compute::Host)
    }

    /// `new`, computing where `compute` says.
    pub fn on(cfg: Config, mut tensors: HashMap<String, QTensor>, rows: HeadRows, compute: Compute) -> Result<Self> {
        let all_f32 = tensors.values().all(|t| t.dtype() == GgmlDType::F32);
        let embd_t = Arc::new(take(&mut tensors, "token_embd.weight")?);
        let head_t = tensors.remove("output.weight").map_or_else(|| embd_t.clone(), Arc::new);
        let head_t = pad_rows_for_kernels(head_t)?;
        let row_head =
            |ids: Option<Vec<u32>>| ids.map(|ids| RowHead::new(&head_t, &ids, cfg.vocab_size, &compute)).transpose();
        let (draft_head, exit_head) = (row_head(rows.draft)?, row_head(rows.exit)?);
        // Tied, no padding needed and on the host: one copy serves both.
        let tied = Arc::ptr_eq(&embd_t, &head_t) && !compute.on_device();
        let embd = Linear::new(embd_t)?;
        let head = if tied { embd.clone() } else { Linear::on(head_t, &compute)? };
        let dev = compute.device();
        let output_norm = norm(&mut tensors, "output_norm.weight")?.to_device(dev)?;
        let exit_gate = match cfg.exit_gate {
            true => Some((
                norm(&mut tensors, "exit_gate.weight")?.t()?.contiguous()?.to_device(dev)?,
                norm(&mut tensors, "exit_gate.bias")?.to_vec1::<f32>()?[0],
            )),
            false => None,
        };
        let layer_bytes: usize = tensors
            .iter()
            .filter(|(name, _)| name.starts_with("pre.") || name.starts_with("blk."))
            .map(|(_, t)| t.storage_size_in_bytes())
            .sum();
        let mut layer = |name: String| match &compute {
            Compute::Host => Layer::load(&mut tensors, &name, &cfg).map(AnyLayer::Host),
            Compute::Device(d) => DevLayer::load(&mut tensors, &name, &cfg, d).map(AnyLayer::Device),
        };
        let prelude: Vec<AnyLayer> =
            (0..cfg.prelude_count).map(|i| layer(format!("pre.{i}"))).collect::<Result<_>>()?;
        let block: Vec<AnyLayer> = (0..cfg.block_count).map(|i| layer(format!("blk.{i}"))).collect::<Result<_>>()?;
        let rope = match &compute {
            Compute::Host => Rope::new(&cfg),
            Compute::Device(d) => Rope::new(&cfg).on_device(d, cfg.context_length)?,
        };
        let kv_kind = if all_f32 { KvKind::F32 } else { KvKind::F16 };
        let use_draft_head = draft_head.is_some();
        let split_batches = layer_bytes <= SPLIT_MAX_BYTES && prelude.iter().chain(&block).all(AnyLayer::own_kernels);
        Ok(Self {
            cfg,
            embd,
            head,
            draft_head,
            exit_head,
            use_draft_head,
            exit_gate,
            output_norm,
            prelude,
            block,
            rope,
            kv_kind,
            kv_share: false,
            split_batches,
            compute,
        })
    }

    /// Where this model computes.
    pub fn compute(&self) -> &Compute {
        &self.compute
    }

    /// Whether adaptive depth follows the file's exit gate (else the settling rule; `AutoDepth`).
    pub fn exit_gated(&self) -> bool {
        self.exit_gate.is_some()
    }

    /// The exit threshold of `loops: "auto"` when a request gives none: the file's, else the rule's default.
    pub fn default_exit_threshold(&self) -> f32 {
        self.cfg.exit_threshold.unwrap_or(match self.exit_gated() {
            true => AutoDepth::DEFAULT_GATE_THRESHOLD,
            false => AutoDepth::DEFAULT_THRESHOLD,
        })
    }

    pub fn kv_kind(&self) -> KvKind {
        self.kv_kind
    }

    /// Store K/V as `kind` in caches made from now on (the "fp16" default is f32 for F32 models, else f16).
    pub fn set_kv_kind(&mut self, kind: KvKind) {
        self.kv_kind = kind;
    }

    pub fn kv_share(&self) -> bool {
        self.kv_share
    }

    /// Make caches made from now on share one slot per block layer across loops once their prompt is in.
    pub fn set_kv_share(&mut self, share: bool) {
        self.kv_share = share;
    }

    /// A fresh cache for one sequence of up to `capacity` positions (memory is touched only as it fills).
    pub fn new_cache(&self, capacity: usize) -> KvCache {
        let shape =
            AttnShape { n_heads: self.cfg.n_heads, n_kv_heads: self.cfg.n_kv_heads, head_dim: self.cfg.head_dim };
        let (prelude, block) = (self.cfg.prelude_count, self.cfg.block_count);
        let mut cache = KvCache::new(self.kv_kind, shape, capacity, prelude + MAX_LOOPS * block);
        if let Compute::Device(d) = &self.compute {
            cache = cache.on_device(d);
        }
        if self.kv_share {
            cache.with_shared_loops(prelude, block)
        } else {
            cache
        }
    }

    /// Cache slot of block layer `layer` in loop `lp` (0-based); prelude layers take the first slots.
    fn slot(&self, lp: usize, layer: usize) -> usize {
        self.cfg.prelude_count + lp * self.cfg.block_count + layer
    }

    /// Token embeddings, `(n, dim)`; every id below `vocab_size` (checked where ids enter: `Generator::new`,
    /// `Engine::score`, `Engine::feed`).
    pub fn embed(&self, tokens: &[u32]) -> Result<Tensor> {
        debug_assert!(tokens.iter().all(|&t| (t as usize) < self.cfg.vocab_size), "token ids are checked on entry");
        profile::time(Stage::Embed, || Ok(self.embd.rows(tokens)?.to_device(self.compute.device())?))
    }

    /// Run the prelude (when `with_prelude`) and then block loops `loops` over `x` (rows of all `seqs`, in order).
    pub fn run(&self, x: Tensor, seqs: &mut [SeqChunk], with_prelude: bool, loops: Range<usize>) -> Result<Tensor> {
        debug_assert!(loops.end <= MAX_LOOPS, "loops are checked on entry");
        profile::time(Stage::Blocks, || {
            let x = if with_prelude { self.prelude_pass(x, seqs)? } else { x };
            loops.into_iter().try_fold(x, |x, lp| self.loop_pass(x, seqs, lp))
        })
    }

    fn prelude_pass(&self, x: Tensor, seqs: &mut [SeqChunk]) -> Result<Tensor> {
        self.prelude.iter().enumerate().try_fold(x, |x, (i, layer)| layer.forward(&self.cfg, &self.rope, &x, seqs, i))
    }

    /// The shared block once, as loop `lp` (0-based); then the final norm, in a model whose loops end with it.
    fn loop_pass(&self, x: Tensor, seqs: &mut [SeqChunk], lp: usize) -> Result<Tensor> {
        let x = self
            .block
            .iter()
            .enumerate()
            .try_fold(x, |x, (j, layer)| layer.forward(&self.cfg, &self.rope, &x, seqs, self.slot(lp, j)))?;
        match self.cfg.loop_norm {
            true => self.rms_output_norm(&x),
            false => Ok(x),
        }
    }

    /// Advance several sequences' rows, each through its own loop range, in shared passes: every loop runs once,
    /// over the rows of all blocks whose range holds it (the prelude first, for blocks starting at loop 0). This is
    /// how a speculative draft or verification shares its weight reads with plain rows of other sequences.
    ///
    /// When the layers' weights are small enough to stay in the last-level cache (`SPLIT_MAX_BYTES`) and all run
    /// tinyloop's own kernels, the sequences are split into one group per pool thread, each group run on its own
    /// thread: a thread reads every weight once more, from the cache, instead of every matmul and attention call
    /// waking the pool (about a hundred round trips per step on the default model, each costing about as much as
    /// its matmul). Each row's arithmetic is the same either way: those kernels' outputs do not depend on the rows
    /// beside them. (candle's Q8_0 kernels, which the others leave some shapes to, ran 16 streams slower split.)
    pub fn run_blocks(&self, blocks: &mut [RowBlock]) -> Result<()> {
        let parts = if self.split_batches { rayon::current_num_threads() } else { 1 };
        profile::time(Stage::Blocks, || self.run_split(blocks, parts))
    }

    /// `run_row_blocks` over `parts` groups of blocks holding about equal numbers of rows, in parallel.
    fn run_split(&self, blocks: &mut [RowBlock], parts: usize) -> Result<()> {
        if parts < 2 || blocks.len() < 2 {
            return self.run_row_blocks(blocks);
        }
        let rows: usize = blocks.iter().map(|b| b.seq.tokens.len()).sum();
        let target = rows * (parts / 2) / parts;
        let (mut at, mut before) = (1, blocks[0].seq.tokens.len());
        while at < blocks.len() - 1 && before + blocks[at].seq.tokens.len() <= target {
            before += blocks[at].seq.tokens.len();
            at += 1;
        }
        let (first, second) = blocks.split_at_mut(at);
        // Each group has its thread: the matmuls inside stay on it (`team::alone`).
        let (a, b) = rayon::join(
            || team::alone(|| self.run_split(first, parts / 2)),
            || profile::muted(|| team::alone(|| self.run_split(second, parts - parts / 2))),
        );
        a.and(b)
    }

    fn run_row_blocks(&self, blocks: &mut [RowBlock]) -> Result<()> {
        let (Some(first), Some(last)) =
            (blocks.iter().map(|b| b.loops.start).min(), blocks.iter().map(|b| b.loops.end).max())
        else {
            return Ok(());
        };
        debug_assert!(last <= MAX_LOOPS, "loops are checked on entry");
        if self.cfg.prelude_count > 0 {
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
                SeqChunk { cache: &mut *seq.cache, pos: seq.pos, tokens: seq.tokens, tree: seq.tree, exits: seq.exits }
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

    /// Tokens the settling rule compares successive loops over: the exit vocabulary, else the draft vocabulary; 0
    /// when it reads the full head.
    pub fn exit_vocab_len(&self) -> usize {
        self.settle_head().map_or(0, RowHead::len)
    }

    /// The head the settling rule's checks read, when not the full head.
    fn settle_head(&self) -> Option<&RowHead> {
        self.exit_head.as_ref().or(self.draft_head.as_ref())
    }

    /// Draft with the file's draft vocabulary (the default when it lists one) or with the full head.
    pub fn set_use_draft_head(&mut self, on: bool) {
        self.use_draft_head = on && self.draft_head.is_some();
    }

    /// Logit rows for speculative drafts: the draft head's (−∞ outside its vocabulary) when in use, else the full
    /// head's. Never used to choose an output token.
    pub fn draft_logits(&self, h: &Tensor) -> Result<Vec<Vec<f32>>> {
        match &self.draft_head {
            Some(d) if self.use_draft_head => {
                profile::time(Stage::Head, || d.logits(&self.final_norm(h)?, self.cfg.vocab_size))
            }
            _ => Ok(self.logits(h)?.to_vec2::<f32>()?),
        }
    }

    /// The head's input: the final norm of `h`, or `h` itself where every loop already ended with it.
    fn final_norm(&self, h: &Tensor) -> Result<Tensor> {
        match self.cfg.loop_norm {
            true => Ok(h.clone()),
            false => self.rms_output_norm(h),
        }
    }

    fn rms_output_norm(&self, h: &Tensor) -> Result<Tensor> {
        Ok(candle_nn::ops::rms_norm(h, &self.output_norm, self.cfg.rms_eps as f32)?)
    }

    /// Final norm and head: `(n, dim)` hidden states to `(n, vocab)` logits, on the host.
    pub fn logits(&self, h: &Tensor) -> Result<Tensor> {
        profile::time(Stage::Head, || Ok(self.head_logits(h)?.to_device(&Device::Cpu)?))
    }

    fn head_logits(&self, h: &Tensor) -> Result<Tensor> {
        let h = self.final_norm(h)?;
        let logits = self.head.forward(&h)?.to_dtype(DType::F32)?;
        match logits.dim(candle_core::D::Minus1)? {
            n if n == self.cfg.vocab_size => Ok(logits),
            _ => Ok(logits.narrow(candle_core::D::Minus1, 0, self.cfg.vocab_size)?.contiguous()?),
        }
    }

    /// The whole model at depth `loops` (in `1..=MAX_LOOPS`) over new tokens of each sequence (at least one each),
    /// returning logits.
    pub fn forward(&self, seqs: &mut [SeqChunk], loops: usize, rows: LogitRows) -> Result<Tensor> {
        debug_assert!((1..=MAX_LOOPS).contains(&loops), "loops are checked on entry");
        debug_assert!(!seqs.is_empty() && seqs.iter().all(|s| !s.tokens.is_empty()), "at least one token per sequence");
        let tokens: Vec<u32> = seqs.iter().flat_map(|s| s.tokens.iter().copied()).collect();
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
                h.index_select(&Tensor::new(ends.as_slice(), h.device())?, 0)?
            }
        };
        self.logits(&h)
    }
}
