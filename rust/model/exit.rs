//! Adaptive depth (`loops: "auto"`): decode rows that run loops one at a time and stop when their next-token
//! distribution has settled (the rule is `generate::AutoDepth`'s). A stopped row leaves the passes — the rows still
//! looping share the rest — and the loops it skipped keep its last loop's K/V at its position
//! (`KvCache::copy_position`), so a later token running those loops attends to it there.

use candle_core::Tensor;

use super::{AutoDepth, Model, RowBlock};
use crate::error::Result;
use crate::profile::{self, Stage};

impl Model {
    /// Run each one-row block (`loops` `0..max_loops` on the way in, `0..exit` on the way out, `x` the hidden state
    /// at the exit) until `rules[i]` stops it, sharing each loop's pass among the rows still going; then fill the
    /// loops each row skipped with its exit loop's K/V.
    pub fn run_auto(&self, blocks: &mut [RowBlock], rules: &[AutoDepth]) -> Result<()> {
        debug_assert!(blocks.iter().all(|b| b.loops.start == 0 && b.seq.tokens.len() == 1 && b.seq.tree.is_none()));
        let ends: Vec<usize> = blocks.iter().map(|b| b.loops.end).collect();
        let last = ends.iter().copied().max().unwrap_or(0);
        let mut prev: Vec<Option<Vec<f32>>> = vec![None; blocks.len()];
        if !self.prelude.is_empty() {
            profile::time(Stage::Blocks, || self.advance(blocks, |_| true, |x, seqs| self.prelude_pass(x, seqs)))?;
        }
        for lp in 0..last {
            profile::time(Stage::Blocks, || {
                self.advance(blocks, |b| b.loops.end > lp, |x, seqs| self.loop_pass(x, seqs, lp))
            })?;
            let d = lp + 1;
            // The rows that need their exit distribution after loop d: from one loop before their first check on.
            let want: Vec<usize> =
                (0..blocks.len()).filter(|&i| blocks[i].loops.end > d && d + 1 >= rules[i].first_check()).collect();
            if want.is_empty() {
                continue;
            }
            let h: Vec<&Tensor> = want.iter().map(|&i| &blocks[i].x).collect();
            let logp = self.exit_logprobs(&Tensor::cat(&h, 0)?)?;
            for (&i, cur) in want.iter().zip(logp) {
                let rule = rules[i];
                if d >= rule.first_check() && prev[i].as_ref().is_some_and(|p| kl_divergence(&cur, p) < rule.threshold)
                {
                    blocks[i].loops.end = d;
                }
                prev[i] = Some(cur);
            }
        }
        for (b, &end) in blocks.iter_mut().zip(&ends) {
            let exit = b.loops.end;
            for lp in exit..end {
                for j in 0..self.cfg.block_count {
                    b.seq.cache.copy_position(self.slot(exit - 1, j), self.slot(lp, j), b.seq.pos)?;
                }
            }
        }
        Ok(())
    }

    /// Log-probabilities of the exit distribution of hidden rows `h (n, dim)`: over the draft vocabulary with the
    /// draft head when the file has one (a twelfth of the full head's cost on the default model), else over all
    /// tokens.
    fn exit_logprobs(&self, h: &Tensor) -> Result<Vec<Vec<f32>>> {
        let logits = profile::time(Stage::Head, || match &self.draft_head {
            Some(d) => d.small_logits(&self.final_norm(h)?),
            None => self.head_logits(h),
        })?;
        Ok(candle_nn::ops::log_softmax(&logits, candle_core::D::Minus1)?.to_vec2::<f32>()?)
    }
}

/// KL(p ‖ q) of two distributions given as log-probabilities.
pub(crate) fn kl_divergence(logp: &[f32], logq: &[f32]) -> f32 {
    logp.iter().zip(logq).map(|(&a, &b)| if a == f32::NEG_INFINITY { 0.0 } else { a.exp() * (a - b) }).sum()
}
