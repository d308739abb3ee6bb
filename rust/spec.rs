//! Self-speculative decoding (chain mode): the model drafts `draft_ahead` tokens one by one at `draft_loops`
//! loops, then verifies them all in one batched pass of only loops `draft_loops..verify_loops` — the draft already
//! computed the first loops' hidden states and K/V for those tokens, exactly as a full-depth pass would (the prefix
//! property, DESIGN section 1). The verifier's choice at each position is made by the same sampler plain
//! generation uses, so greedy output is the plain output at `verify_loops`, token for token. Rows after the first
//! disagreement are rolled back in every loop's cache. With temperature > 0 the draft samples from its own
//! distribution q and the verifier keeps or resamples by the speculative-sampling rule, so every output token is
//! distributed exactly as plain sampling at `verify_loops` would distribute it.

use candle_core::Tensor;

use crate::batch::{Member, Work};
use crate::engine::Generator;
use crate::ensure_arg;
use crate::error::{Error, Result};
use crate::loader::MAX_LOOPS;

pub use crate::tree::top_k;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecConfig {
    pub draft_loops: usize,
    pub draft_ahead: usize,
    /// Candidates per draft depth: 1 is chain mode, more is tree mode (rust/tree.rs), greedy only.
    pub k_branches: usize,
}

/// Most rows one verification pass may hold (`k_branches · draft_ahead`).
pub const MAX_TREE_ROWS: usize = 64;

/// A chain round in flight: row j feeds `inputs[j]` at position pos + j; the drafts' hidden states after loops
/// `0..draft_loops` are where verification resumes.
pub(crate) struct ChainRound {
    pub cfg: SpecConfig,
    /// Rows drafted this round (`draft_ahead`, fewer near `max_tokens`).
    pub k: usize,
    pub inputs: Vec<u32>,
    pub hidden: Vec<Tensor>,
    proposals: Vec<Vec<(u32, f64)>>,
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
        ensure_arg!(
            cfg.draft_loops >= 1 && cfg.draft_loops < self.loops,
            "draft_loops ({}) must be at least 1 and below verify_loops ({})",
            cfg.draft_loops,
            self.loops
        );
        ensure_arg!((1..=MAX_LOOPS).contains(&cfg.draft_ahead), "draft_ahead must be in 1..={MAX_LOOPS}");
        ensure_arg!(
            cfg.k_branches >= 1 && cfg.k_branches * cfg.draft_ahead <= MAX_TREE_ROWS,
            "K_branches * draft_ahead must be between 1 and {MAX_TREE_ROWS}, got {} * {}",
            cfg.k_branches,
            cfg.draft_ahead
        );
        ensure_arg!(
            cfg.k_branches == 1 || self.sampler.params().temperature == 0.0,
            "tree speculative decoding (K_branches > 1) is greedy-only: set temperature to 0"
        );
        self.spec = Some(cfg);
        Ok(self)
    }

    /// One draft + verify round; queues the verified steps in `self.ready`. Chain rounds run through the batch
    /// scheduler (rust/batch.rs), here as a batch of one.
    pub(crate) fn speculative_round(&mut self, cfg: SpecConfig) -> Result<()> {
        if cfg.k_branches > 1 {
            return self.tree_round(cfg);
        }
        crate::batch::run_group(&mut [Member { gen: self, work: Work::Chain(cfg) }])
    }

    /// Begin a chain round from the pending token (which stays pending until `finish_chain`, so a failed pass
    /// leaves the generator as it was).
    pub(crate) fn start_chain(&self, cfg: SpecConfig) -> Result<ChainRound> {
        let x0 = self.pending.ok_or_else(|| Error::Internal("speculative round without a pending token".into()))?;
        let remaining = self.sampler.params().max_tokens - self.output.len();
        let k = cfg.draft_ahead.min(remaining).max(1);
        Ok(ChainRound { cfg, k, inputs: vec![x0], hidden: Vec::with_capacity(k), proposals: Vec::with_capacity(k) })
    }

    /// Draft row `j` went through loops `0..draft_loops` to hidden state `h` with draft logits `logits`: draw the
    /// proposal from the draft distribution q_j (the request's own temperature / top-k / top-p / penalties).
    pub(crate) fn propose(&mut self, round: &mut ChainRound, h: Tensor, mut logits: Vec<f32>) {
        let q = self.sampler.distribution(&mut logits);
        round.inputs.push(self.sampler.draw(&q));
        round.proposals.push(q);
        round.hidden.push(h);
    }

    /// The verifier's logits for rows `0..k` (loops `draft_loops..verify_loops` over the drafts' hidden states):
    /// emit the verified tokens and roll back the rows after the first disagreement.
    pub(crate) fn finish_chain(&mut self, round: ChainRound, logits: Vec<Vec<f32>>) {
        self.pending = None;
        self.draft.rounds += 1;
        self.draft.proposed += round.k;
        let mut fed = 0;
        for (j, (mut row, q)) in logits.into_iter().zip(&round.proposals).enumerate() {
            fed = j + 1; // rows 0..=j hold tokens that are part of the output: their K/V stays
            let p = self.sampler.distribution(&mut row);
            let (token, agreed) = self.verify(round.inputs[j + 1], &p, q);
            let step = self.emit(token);
            self.ready.push_back(step);
            self.draft.accepted += usize::from(agreed);
            if !agreed || step.finish.is_some() {
                break;
            }
        }
        self.pos += fed;
        self.cache.truncate(self.pos);
    }

    /// Speculative sampling: keep the draft `t` with probability min(1, p(t)/q(t)), else draw from the
    /// normalised residual max(0, p − q). The kept token is then distributed exactly as p. With point masses
    /// (greedy) this is "keep t iff it is p's argmax, else take the argmax".
    fn verify(&mut self, t: u32, p: &[(u32, f64)], q: &[(u32, f64)]) -> (u32, bool) {
        let prob = |d: &[(u32, f64)], x: u32| d.iter().find(|e| e.0 == x).map_or(0.0, |e| e.1);
        let (pt, qt) = (prob(p, t), prob(q, t));
        let keep = pt >= qt || (qt > 0.0 && self.sampler.uniform() < pt / qt);
        if keep && pt > 0.0 {
            return (t, true);
        }
        let q_of: std::collections::HashMap<u32, f64> = q.iter().copied().collect();
        let residual: Vec<(u32, f64)> = p
            .iter()
            .map(|&(x, px)| (x, (px - q_of.get(&x).copied().unwrap_or(0.0)).max(0.0)))
            .filter(|e| e.1 > 0.0)
            .collect();
        let token = if residual.is_empty() { self.sampler.draw(p) } else { self.sampler.draw(&residual) };
        (token, false)
    }
}
