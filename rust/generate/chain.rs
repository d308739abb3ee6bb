//! Self-speculative decoding (chain mode): the model drafts `draft_ahead` tokens one by one at `draft_loops`
//! loops, then verifies them all in one batched pass of only loops `draft_loops..verify_loops` — the draft already
//! computed the first loops' hidden states and K/V for those tokens, exactly as a full-depth pass would (the prefix
//! property, docs/architecture.md). The verifier's choice at each position is made by the same sampler plain
//! generation uses, so greedy output is the plain output at `verify_loops`, token for token. Rows after the first
//! disagreement are rolled back in every loop's cache. With temperature > 0 the draft samples from its own
//! distribution q and the verifier keeps or resamples by the speculative-sampling rule, so every output token is
//! distributed exactly as plain sampling at `verify_loops` would distribute it.
//!
//! A round's passes are run by the batch scheduler (`batch.rs`), alone or alongside other sequences' rows.

use candle_core::Tensor;

use super::plan::Speculative;
use super::seq::SeqState;
use crate::error::{Error, Result};
use crate::sampler::{Dist, Sampler};

/// A chain round in flight: row j feeds `inputs[j]` at position pos + j; the drafts' hidden states after loops
/// `0..draft_loops` are where verification resumes.
pub(super) struct ChainRound {
    pub spec: Speculative,
    /// Rows drafted this round (`draft_ahead`, fewer near `max_tokens`).
    pub k: usize,
    pub inputs: Vec<u32>,
    pub hidden: Vec<Tensor>,
    proposals: Vec<Dist>,
}

impl ChainRound {
    /// Begin a round from the pending token (which stays pending until `finish`, so a failed pass leaves the
    /// sequence as it was — its grammar too: drafts a failed round advanced it by are undone here).
    pub fn start(seq: &mut SeqState, spec: Speculative) -> Result<Self> {
        seq.sampler.rewind_drafts();
        let x0 = seq.pending.ok_or_else(|| Error::Internal("speculative round without a pending token".into()))?;
        let k = spec.draft_ahead.min(seq.remaining()).max(1);
        Ok(Self { spec, k, inputs: vec![x0], hidden: Vec::with_capacity(k), proposals: Vec::with_capacity(k) })
    }

    /// Draft row `j` went through loops `0..draft_loops` to hidden state `h` with draft logits `logits`: draw the
    /// proposal from the draft distribution q_j (the request's own temperature / top-k / top-p / penalties).
    pub fn propose(&mut self, seq: &mut SeqState, h: Tensor, mut logits: Vec<f32>) {
        let q = seq.sampler.proposal(&mut logits);
        let token = seq.sampler.draw(&q);
        seq.sampler.draft(token);
        self.inputs.push(token);
        self.proposals.push(q);
        self.hidden.push(h);
    }

    /// The verifier's logits for rows `0..k` (loops `draft_loops..verify_loops` over the drafts' hidden states):
    /// emit the verified tokens and roll back the rows after the first disagreement.
    pub fn finish(self, seq: &mut SeqState, logits: Vec<Vec<f32>>) {
        seq.pending = None;
        seq.sampler.rewind_drafts();
        seq.draft.rounds += 1;
        seq.draft.proposed += self.k;
        let mut fed = 0;
        for (j, (mut row, q)) in logits.into_iter().zip(&self.proposals).enumerate() {
            fed = j + 1; // rows 0..=j hold tokens that are part of the output: their K/V stays
            let p = seq.sampler.distribution(&mut row);
            let (token, agreed) = verify(&mut seq.sampler, self.inputs[j + 1], &p, q);
            seq.sampler.recycle(p);
            let step = seq.emit(token);
            seq.ready.push_back(step);
            seq.draft.accepted += usize::from(agreed);
            if !agreed || step.finish.is_some() {
                break;
            }
        }
        self.proposals.into_iter().for_each(|q| seq.sampler.recycle(q));
        seq.commit(fed);
    }
}

/// Speculative sampling: keep the draft `t` with probability min(1, p(t)/q(t)), else draw from the
/// normalised residual max(0, p − q). The kept token is then distributed exactly as p. With point masses
/// (greedy) this is "keep t iff it is p's argmax, else take the argmax".
fn verify(sampler: &mut Sampler, t: u32, p: &Dist, q: &Dist) -> (u32, bool) {
    let (pt, qt) = (p.prob(t), q.prob(t));
    let keep = pt >= qt || (qt > 0.0 && sampler.uniform() < pt / qt);
    if keep && pt > 0.0 {
        return (t, true);
    }
    let token = match Dist::residual(p, q) {
        Some(residual) => sampler.draw(&residual),
        None => sampler.draw(p),
    };
    (token, false)
}
