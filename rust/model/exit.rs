//! Adaptive depth (`loops: "auto"`, the rules in `depth.rs`): rows that run loops one at a time and stop when the
//! model's exit rule says so (their next-token distribution has settled, or the file's exit gate is confident). A decode row that stops leaves the passes — the rows still looping share the
//! rest; a speculative round's rows stop one by one and stay in the passes until the last one stops, a stopped row
//! holding its exit loop's K/V in each later loop (`SeqChunk::exits`). The loops a row skipped keep its last loop's
//! K/V at its position (`KvCache::copy_position`), so a later token running those loops attends to it there.

use candle_core::{DType, Tensor};

use super::{AutoDepth, Model, RowBlock, SeqChunk};
use crate::error::{Error, Result};
use crate::kernels::simd;
use crate::profile::{self, Stage};

impl Model {
    /// Run each block's rows from `loops.start` until `rules[i]` stops each row (at `loops.end` at the latest),
    /// sharing each loop's pass among the blocks still running; returns each block's rows' exits (the loops each
    /// ran) and leaves in `x` each row's hidden state at its exit. A block of one row leaves the passes when it
    /// stops; a block of several (a speculative round's rows) runs until its last row stops, its stopped rows
    /// computed but holding their exit loop's K/V (`SeqChunk::exits`). Then every skipped loop's slot gets each
    /// row's exit-loop K/V.
    pub fn run_auto(&self, blocks: &mut [RowBlock], rules: &[AutoDepth]) -> Result<Vec<Vec<usize>>> {
        debug_assert!(blocks.iter().all(|b| b.seq.tree.is_none() && b.seq.exits.is_none()));
        // The gate's survival product starts at loop 1: its rows enter at loop 0 (drafts are refused with it).
        debug_assert!(!self.exit_gated() || blocks.iter().all(|b| b.loops.start == 0));
        let ends: Vec<usize> = blocks.iter().map(|b| b.loops.end).collect();
        let mut exits: Vec<Vec<usize>> = blocks.iter().map(|b| vec![usize::MAX; b.seq.tokens.len()]).collect();
        let mut held: Vec<Vec<Option<Tensor>>> = exits.iter().map(|e| vec![None; e.len()]).collect();
        let mut prev: Vec<Vec<Option<Vec<f32>>>> = exits.iter().map(|e| vec![None; e.len()]).collect();
        if self.cfg.prelude_count > 0 {
            let starting = |b: &RowBlock| b.loops.start == 0;
            profile::time(Stage::Blocks, || self.advance(blocks, starting, |x, seqs| self.prelude_pass(x, seqs)))?;
        }
        let first = blocks.iter().map(|b| b.loops.start).min().unwrap_or(0);
        let last = ends.iter().copied().max().unwrap_or(0);
        // Rows entering after loop 0 whose first check needs the distribution they enter with.
        self.exit_checks(blocks, rules, &mut exits, &mut held, &mut prev, |b| b.loops.start)?;
        for lp in first..last {
            let running: Vec<bool> = (0..blocks.len())
                .map(|i| blocks[i].loops.start <= lp && lp < ends[i] && exits[i].contains(&usize::MAX))
                .collect();
            profile::time(Stage::Blocks, || self.auto_pass(blocks, &running, &exits, lp))?;
            self.exit_checks(blocks, rules, &mut exits, &mut held, &mut prev, |b| {
                if b.loops.start <= lp {
                    lp + 1
                } else {
                    0
                }
            })?;
        }
        for (i, b) in blocks.iter_mut().enumerate() {
            self.settle(b, &mut exits[i], &mut held[i], ends[i])?;
        }
        Ok(exits)
    }

    /// A block's rows after the passes: each one's hidden state at its exit in `x` (a row that never stopped ran to
    /// `end`), and the loops after the block's last pass filled with each row's exit-loop K/V (the loops between a
    /// row's exit and that were filled in the passes).
    fn settle(&self, b: &mut RowBlock, exits: &mut [usize], held: &mut [Option<Tensor>], end: usize) -> Result<()> {
        let mut rows = Vec::with_capacity(exits.len());
        for (r, exit) in exits.iter_mut().enumerate() {
            rows.push(match held[r].take() {
                Some(x) => x,
                None => {
                    *exit = end;
                    b.x.narrow(0, r, 1)?
                }
            });
        }
        b.x = if rows.len() == 1 { rows.swap_remove(0) } else { Tensor::cat(&rows, 0)? };
        let stop = exits.iter().copied().max().unwrap_or(end);
        for lp in stop..end {
            for (r, &exit) in exits.iter().enumerate() {
                for j in 0..self.cfg.block_count {
                    b.seq.cache.copy_position(self.slot(exit - 1, j), self.slot(lp, j), b.seq.pos + r)?;
                }
            }
        }
        b.loops.end = stop;
        Ok(())
    }

    /// One loop `lp` over the running blocks, each with its rows' exits so far.
    fn auto_pass(&self, blocks: &mut [RowBlock], running: &[bool], exits: &[Vec<usize>], lp: usize) -> Result<()> {
        let chosen: Vec<(usize, &mut RowBlock)> = blocks.iter_mut().enumerate().filter(|(i, _)| running[*i]).collect();
        if chosen.is_empty() {
            return Ok(());
        }
        let xs: Vec<&Tensor> = chosen.iter().map(|(_, b)| &b.x).collect();
        let x = if xs.len() == 1 { xs[0].clone() } else { Tensor::cat(&xs, 0)? };
        let mut rows = Vec::with_capacity(chosen.len());
        let mut seqs: Vec<SeqChunk> = chosen
            .into_iter()
            .map(|(i, RowBlock { seq, x, .. })| {
                rows.push((seq.tokens.len(), x));
                let stopped = exits[i].iter().any(|&e| e != usize::MAX);
                let exits = stopped.then_some(exits[i].as_slice());
                SeqChunk { cache: &mut *seq.cache, pos: seq.pos, tokens: seq.tokens, tree: None, exits }
            })
            .collect();
        let y = self.loop_pass(x, &mut seqs, lp)?;
        drop(seqs);
        let mut off = 0;
        for (n, x) in rows {
            *x = y.narrow(0, off, n)?;
            off += n;
        }
        Ok(())
    }

    /// After loop `d = at(block)` (0: not now): each running row gets its rule's measure — the exit distribution
    /// (settling, from loop `first_check − 1`) or its survival `Π (1 − λ_j)` (the gate, from loop 1) — kept in
    /// `prev`; a row whose rule is met at `d ≥ first_check` stops at `d`.
    fn exit_checks(
        &self,
        blocks: &[RowBlock],
        rules: &[AutoDepth],
        exits: &mut [Vec<usize>],
        held: &mut [Vec<Option<Tensor>>],
        prev: &mut [Vec<Option<Vec<f32>>>],
        at: impl Fn(&RowBlock) -> usize,
    ) -> Result<()> {
        let gated = self.exit_gated();
        let mut want = Vec::new();
        for (i, b) in blocks.iter().enumerate() {
            let d = at(b);
            if d == 0 || d >= b.loops.end || (!gated && d + 1 < rules[i].first_check(false)) {
                continue;
            }
            want.extend((0..exits[i].len()).filter(|&r| exits[i][r] == usize::MAX).map(|r| (i, r, d)));
        }
        if want.is_empty() {
            return Ok(());
        }
        let h: Vec<Tensor> =
            want.iter().map(|&(i, r, _)| blocks[i].x.narrow(0, r, 1)).collect::<candle_core::Result<_>>()?;
        let h_all = Tensor::cat(&h, 0)?;
        let measures: Vec<(Vec<f32>, Vec<f32>)> = match gated {
            true => self.exit_gate_probs(&h_all)?.into_iter().map(|p| (vec![p], Vec::new())).collect(),
            false => self.exit_logprobs(&h_all)?,
        };
        for ((i, r, d), ((cur, probs), x)) in want.into_iter().zip(measures.into_iter().zip(h)) {
            let threshold = rules[i].threshold.unwrap_or_else(|| self.default_exit_threshold());
            let (met, keep) = match gated {
                true => {
                    let survival = prev[i][r].as_ref().map_or(1.0, |s| s[0]) * (1.0 - cur[0]);
                    (1.0 - survival >= threshold, vec![survival])
                }
                false => (prev[i][r].as_ref().is_some_and(|q| kl_divergence(&probs, &cur, q) < threshold), cur),
            };
            if d >= rules[i].first_check(gated) && met {
                exits[i][r] = d;
                held[i][r] = Some(x);
            }
            prev[i][r] = Some(keep);
        }
        Ok(())
    }

    /// The exit gate's probability `σ(w · h + b)` for each of the hidden rows `h (n, dim)`, on their normed states.
    fn exit_gate_probs(&self, h: &Tensor) -> Result<Vec<f32>> {
        let (w, b) = self.exit_gate.as_ref().ok_or_else(|| Error::Internal("no exit gate".into()))?;
        let z = self.final_norm(h)?.to_dtype(DType::F32)?.matmul(w)?.flatten_all()?.to_vec1::<f32>()?;
        Ok(z.into_iter().map(|z| 1.0 / (1.0 + (-(z + b)).exp())).collect())
    }

    /// The exit distribution of hidden rows `h (n, dim)`, each row as (log-probabilities, probabilities): over the
    /// file's exit vocabulary when it lists one (256 tokens on the default model: a two-hundredth of the full head's
    /// cost), else over its draft vocabulary, else over all tokens. One vectorized exponential pass per row gives
    /// both.
    fn exit_logprobs(&self, h: &Tensor) -> Result<Vec<(Vec<f32>, Vec<f32>)>> {
        let logits = profile::time(Stage::Head, || match self.settle_head() {
            Some(d) => d.small_logits(&self.final_norm(h)?),
            None => self.head_logits(h),
        })?;
        Ok(logits.to_vec2::<f32>()?.iter().map(|z| simd::log_softmax(z)).collect())
    }
}

/// KL(p ‖ q) from p's probabilities and log-probabilities and q's log-probabilities; never below 0 (rounding can
/// take the sum of two equal distributions a hair under it).
pub(crate) fn kl_divergence(p: &[f32], logp: &[f32], logq: &[f32]) -> f32 {
    let sum: f32 = p.iter().zip(logp).zip(logq).map(|((&p, &a), &b)| if p > 0.0 { p * (a - b) } else { 0.0 }).sum();
    sum.max(0.0)
}
