//! Self-speculative decoding (chain mode): the model drafts `draft_ahead` tokens one by one at `draft_loops`
//! loops, then verifies them all in one batched pass of only loops `draft_loops..verify_loops` — the draft already
//! computed the first loops' hidden states and K/V for those tokens, exactly as a full-depth pass would (the prefix
//! property, DESIGN section 1). The verifier's choice at each position is made by the same sampler plain
//! generation uses, so greedy output is the plain output at `verify_loops`, token for token. Rows after the first
//! disagreement are rolled back in every loop's cache.

use candle_core::{Tensor, D};

use crate::engine::Generator;
use crate::ensure_arg;
use crate::error::{Error, Result};
use crate::loader::MAX_LOOPS;
use crate::model::SeqChunk;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecConfig {
    pub draft_loops: usize,
    pub draft_ahead: usize,
}

/// Counters of drafted tokens (LM Studio's names in the API).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DraftStats {
    pub rounds: usize,
    pub proposed: usize,
    pub accepted: usize,
}

impl Generator {
    /// Switch this generator to self-speculative decoding; its `loops` becomes the verify depth.
    pub fn with_speculation(mut self, cfg: SpecConfig) -> Result<Self> {
        ensure_arg!(cfg.draft_loops >= 1 && cfg.draft_loops < self.loops,
            "draft_loops ({}) must be at least 1 and below verify_loops ({})", cfg.draft_loops, self.loops);
        ensure_arg!((1..=MAX_LOOPS).contains(&cfg.draft_ahead), "draft_ahead must be in 1..={MAX_LOOPS}");
        ensure_arg!(self.sampler.params().temperature == 0.0,
            "speculative decoding is greedy-only in this build: set temperature to 0");
        self.spec = Some(cfg);
        Ok(self)
    }

    /// One draft + verify round; queues the verified steps in `self.ready`.
    pub(crate) fn speculative_round(&mut self, cfg: SpecConfig) -> Result<()> {
        let model = &self.engine.model;
        let x0 = self.pending.take().ok_or_else(|| Error::Internal("speculative round without a pending token".into()))?;
        let remaining = self.sampler.params().max_tokens - self.output.len();
        let k = cfg.draft_ahead.min(remaining).max(1);
        // Draft: row j feeds inputs[j] at position pos + j through loops 0..d and proposes inputs[j + 1].
        let mut inputs = vec![x0];
        let mut hidden = Vec::with_capacity(k);
        for j in 0..k {
            let tok = [inputs[j]];
            let mut seqs = [SeqChunk { cache: &mut self.cache, pos: self.pos + j, tokens: &tok }];
            let h = model.run(model.embed(&tok)?, &mut seqs, true, 0..cfg.draft_loops)?;
            inputs.push(model.logits(&h)?.argmax(D::Minus1)?.to_vec1::<u32>()?[0]);
            hidden.push(h);
        }
        // Verify rows 0..k in one pass over the remaining loops.
        let mut seqs = [SeqChunk { cache: &mut self.cache, pos: self.pos, tokens: &inputs[..k] }];
        let h = model.run(Tensor::cat(&hidden, 0)?, &mut seqs, false, cfg.draft_loops..self.loops)?;
        let logits = model.logits(&h)?.to_vec2::<f32>()?;
        self.draft.rounds += 1;
        self.draft.proposed += k;
        let mut fed = 0;
        for (j, mut row) in logits.into_iter().enumerate() {
            fed = j + 1; // rows 0..=j hold tokens that are part of the output: their K/V stays
            let token = self.sampler.sample(&mut row);
            let agreed = token == inputs[j + 1];
            let step = self.emit(token);
            self.ready.push_back(step);
            self.draft.accepted += usize::from(agreed);
            if !agreed || step.finish.is_some() {
                break;
            }
        }
        self.pos += fed;
        self.cache.truncate(self.pos);
        Ok(())
    }
}
