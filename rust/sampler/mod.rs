//! Turning logits into the next token: penalties, temperature, top-k, exact top-p, seeded sampling.
//!
//! Order of operations (each step is skipped at its neutral value):
//! 1. `repetition_penalty` (CTRL): for every token seen in the prompt or the output, a positive logit is divided by
//!    the penalty and a negative one multiplied by it, so > 1 penalises.
//! 2. OpenAI penalties over generated tokens: `logit -= presence·[count > 0] + frequency·count`.
//! 3. Before `min_tokens` tokens (or always with `ignore_eos`), end-of-sequence and stop ids are masked out; with a
//!    grammar (`crate::grammar`), every token it does not allow next is masked out.
//! 4. `temperature == 0` → argmax (lowest id wins a tie). Otherwise divide by T, keep the top-k (0 = all),
//!    softmax, keep the smallest set whose mass ≥ top_p (ties in descending-probability order broken by lower
//!    id), renormalise and draw with a ChaCha8 RNG seeded by `seed` (fresh entropy when there is none): a
//!    uniform number located in the cumulative weights — in id order when every token is kept, in descending
//!    probability otherwise (`dist.rs`, which builds the distribution without sorting the vocabulary). Top-p
//!    without top-k draws from every token and redraws until the draw lies in the nucleus, which is the nucleus
//!    distribution exactly and needs no cut (`dist::draw_nucleus`); the built distribution serves speculative
//!    verification, which needs the probabilities themselves.
//!
//! With `logprobs`, each row is scored before step 1 and the emitted token's log-probability under the raw logits
//! kept (`logprobs.rs`).

mod dist;
mod logprobs;

use std::collections::HashMap;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub use self::dist::Dist;
use self::dist::Scratch;
use self::logprobs::Scored;
pub use self::logprobs::{top_ids, TokenLogprob};
use crate::ensure_arg;
use crate::error::Result;
use crate::grammar::Constraint;
pub use crate::kernels::logits::argmax;
use crate::limits::MAX_LOGPROBS;

#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub repetition_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub seed: Option<u64>,
    pub max_tokens: usize,
    pub min_tokens: usize,
    pub ignore_eos: bool,
    pub stop_token_ids: Vec<u32>,
    /// Record each emitted token's log-probability with this many alternatives (`logprobs.rs`); None: off.
    pub logprobs: Option<usize>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            max_tokens: 128,
            min_tokens: 0,
            ignore_eos: false,
            stop_token_ids: Vec::new(),
            logprobs: None,
        }
    }
}

impl SamplingParams {
    /// Reject values no sampler can honour (the HTTP layer applies the API's narrower ranges first). Called by
    /// `Generator::new` (as part of `Generation::validate`) and by the Python constructor, which fails early.
    pub fn validate(&self) -> Result<()> {
        ensure_arg!(
            self.temperature.is_finite() && self.temperature >= 0.0,
            "temperature must be >= 0, got {}",
            self.temperature
        );
        ensure_arg!((0.0..=1.0).contains(&self.top_p), "top_p must be in [0, 1], got {}", self.top_p);
        ensure_arg!(
            self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0,
            "repetition_penalty must be > 0, got {}",
            self.repetition_penalty
        );
        ensure_arg!(self.presence_penalty.is_finite(), "presence_penalty must be finite");
        ensure_arg!(self.frequency_penalty.is_finite(), "frequency_penalty must be finite");
        ensure_arg!(self.max_tokens >= 1, "max_tokens must be >= 1");
        ensure_arg!(
            self.logprobs.is_none_or(|n| n <= MAX_LOGPROBS),
            "logprobs must be in 0..={MAX_LOGPROBS}, got {}",
            self.logprobs.unwrap_or_default()
        );
        ensure_arg!(
            self.min_tokens <= self.max_tokens,
            "min_tokens ({}) must not exceed max_tokens ({})",
            self.min_tokens,
            self.max_tokens
        );
        Ok(())
    }
}

pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    /// Tokens of prompt and output (for the repetition penalty): membership by id, and the ids in a list.
    seen: Vec<bool>,
    seen_ids: Vec<u32>,
    /// How often each token was generated (for presence/frequency).
    counts: HashMap<u32, u32>,
    generated: usize,
    /// The tokens that end the sequence as end-of-sequence does (the model file's: `Tokenizer::end_ids`).
    eos: Vec<u32>,
    scratch: Scratch,
    constraint: Option<Constraint>,
    /// The last row `process` saw, scored, until its token is accepted (only with `params.logprobs`).
    scored: Option<Scored>,
    logprobs: Vec<TokenLogprob>,
}

impl Sampler {
    /// A sampler for `params` (validated where they entered: `Generator::new`).
    pub fn new(params: SamplingParams, prompt: &[u32], vocab: usize, eos: &[u32]) -> Self {
        debug_assert!(params.validate().is_ok(), "sampling parameters are validated on entry");
        let rng = match params.seed {
            Some(s) => ChaCha8Rng::seed_from_u64(s),
            None => ChaCha8Rng::from_rng(&mut rand::rng()),
        };
        let mut s = Self {
            params,
            rng,
            seen: vec![false; vocab],
            seen_ids: Vec::new(),
            counts: HashMap::new(),
            generated: 0,
            eos: eos.to_vec(),
            scratch: Scratch::default(),
            constraint: None,
            scored: None,
            logprobs: Vec::new(),
        };
        prompt.iter().for_each(|&t| s.see(t));
        s
    }

    /// The same sampler, choosing only tokens `constraint` allows.
    pub fn constrained(self, constraint: Option<Constraint>) -> Self {
        Self { constraint, ..self }
    }

    fn see(&mut self, token: u32) {
        if let Some(s) = self.seen.get_mut(token as usize).filter(|s| !**s) {
            *s = true;
            self.seen_ids.push(token);
        }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Record a generated token (penalty state, the min_tokens count, the grammar's state).
    pub fn accept(&mut self, token: u32) {
        self.see(token);
        *self.counts.entry(token).or_insert(0) += 1;
        self.generated += 1;
        if let Some(c) = &mut self.constraint {
            c.consume(token);
        }
        if let Some(scored) = self.scored.take() {
            self.logprobs.push(scored.entry(token));
        }
        debug_assert!(self.params.logprobs.is_none() || self.logprobs.len() == self.generated);
    }

    /// The emitted tokens' log-probabilities (empty unless `params.logprobs`).
    pub fn logprobs(&self) -> &[TokenLogprob] {
        &self.logprobs
    }

    /// A speculative round drafted `token`: the grammar advances by it until `rewind_drafts`, so the next draft is
    /// drawn under the grammar too.
    pub fn draft(&mut self, token: u32) {
        let ends = self.is_stop(token);
        if let Some(c) = &mut self.constraint {
            c.draft(token, ends);
        }
    }

    /// Undo the grammar's advance over this round's drafts (before verification).
    pub fn rewind_drafts(&mut self) {
        if let Some(c) = &mut self.constraint {
            c.rewind_drafts();
        }
    }

    /// Only the grammar's mask (tree drafts rank raw draft logits).
    pub fn constrain(&mut self, logits: &mut [f32]) {
        if let Some(c) = &mut self.constraint {
            c.mask(logits);
        }
    }

    /// The grammar is complete: nothing more may follow.
    pub fn grammar_complete(&self) -> bool {
        self.constraint.as_ref().is_some_and(Constraint::is_complete)
    }

    /// Why the grammar failed mid-output, if it did.
    pub fn grammar_error(&self) -> Option<&str> {
        self.constraint.as_ref().and_then(Constraint::error)
    }

    /// True if `token` ends the sequence (EOS unless ignored, or a stop id).
    pub fn is_stop(&self, token: u32) -> bool {
        (self.eos.contains(&token) && !self.params.ignore_eos) || self.params.stop_token_ids.contains(&token)
    }

    /// Steps 1–3 of the module doc, in place; `score`: keep the row's log-probabilities for `accept` (a draft's
    /// row is never scored — its token is not output, and verification scores the row that emits one).
    fn process(&mut self, logits: &mut [f32], score: bool) {
        if let Some(n) = self.params.logprobs.filter(|_| score) {
            self.scored = Some(Scored::of(logits, n));
        }
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            for &t in &self.seen_ids {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l > 0.0 { *l / p.repetition_penalty } else { *l * p.repetition_penalty };
                }
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&t, &c) in &self.counts {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l -= p.presence_penalty + p.frequency_penalty * c as f32;
                }
            }
        }
        let early = self.generated < p.min_tokens;
        let mut mask = |t: u32| {
            if let Some(l) = logits.get_mut(t as usize) {
                *l = f32::NEG_INFINITY;
            }
        };
        if early || p.ignore_eos {
            self.eos.iter().for_each(|&t| mask(t));
        }
        if early {
            p.stop_token_ids.iter().for_each(|&t| mask(t));
        }
        self.constrain(logits);
    }

    /// Choose the next token from raw logits (modified in place).
    pub fn sample(&mut self, logits: &mut [f32]) -> u32 {
        self.process(logits, true);
        let p = &self.params;
        if p.temperature == 0.0 {
            return argmax(logits);
        }
        if p.top_k == 0 && (dist::REJECTION_TOP_P..1.0).contains(&p.top_p) {
            let rng = &mut self.rng;
            if let Some(token) = dist::draw_nucleus(logits, p.temperature, p.top_p, &mut self.scratch, || rng.random())
            {
                return token;
            }
        }
        let dist = dist::build(logits, p.temperature, p.top_k, p.top_p, &mut self.scratch);
        let token = self.draw(&dist);
        self.scratch.give_back(dist); // its buffers serve the next token
        token
    }

    /// The distribution `sample` draws from: steps 1–4 of the module doc. Greedy is a point mass.
    pub fn distribution(&mut self, logits: &mut [f32]) -> Dist {
        self.distribution_of(logits, true)
    }

    /// A draft's proposal distribution: `distribution` without scoring the row.
    pub fn proposal(&mut self, logits: &mut [f32]) -> Dist {
        self.distribution_of(logits, false)
    }

    fn distribution_of(&mut self, logits: &mut [f32], score: bool) -> Dist {
        self.process(logits, score);
        let p = &self.params;
        if p.temperature == 0.0 {
            return Dist::Point(argmax(logits));
        }
        dist::build(logits, p.temperature, p.top_k, p.top_p, &mut self.scratch)
    }

    /// A distribution no longer needed: its buffers serve the next one.
    pub fn recycle(&mut self, dist: Dist) {
        self.scratch.give_back(dist);
    }

    /// Draw from a distribution (one that holds a single token takes no randomness).
    pub fn draw(&mut self, dist: &Dist) -> u32 {
        match dist {
            Dist::Point(t) => *t,
            Dist::Sparse { items, .. } if items.len() == 1 => items[0].0,
            _ => dist.draw(self.rng.random::<f64>()),
        }
    }

    /// A uniform draw in [0, 1) from the request's RNG (speculative acceptance tests).
    pub fn uniform(&mut self) -> f64 {
        self.rng.random::<f64>()
    }
}

#[cfg(test)]
mod tests;
