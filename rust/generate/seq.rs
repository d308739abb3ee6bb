//! One sequence's decoding state — its cache, sampler, position and emitted tokens — and the two ways a step ends:
//! `finish_step` after a plain pass, `commit` after a speculative round. `Generator` owns one; the speculative
//! rounds (`chain.rs`, `tree.rs`) and the batch scheduler (`batch.rs`) work on it.

use std::collections::VecDeque;

use crate::kv::KvCache;
use crate::sampler::Sampler;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS or a stop token id was sampled (the stop token is not part of the output).
    Stop,
    /// `max_tokens` reached.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// What one step produced: a token, the end of the sequence, or both (the last token before `length`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Step {
    pub token: Option<u32>,
    pub finish: Option<FinishReason>,
}

/// Counters of drafted tokens (LM Studio's names in the API).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DraftStats {
    pub rounds: usize,
    pub proposed: usize,
    pub accepted: usize,
}

/// Loops run by the tokens an adaptive depth decided (`loops: "auto"`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DepthStats {
    pub tokens: usize,
    pub loops: usize,
}

impl DepthStats {
    pub fn record(&mut self, loops: usize) {
        self.tokens += 1;
        self.loops += loops;
    }
}

pub(super) struct SeqState {
    pub cache: KvCache,
    pub sampler: Sampler,
    pub prompt: Vec<u32>,
    /// Positions whose K/V are complete at every loop (prompt + fed output).
    pub pos: usize,
    /// The last emitted token, not yet fed to the model.
    pub pending: Option<u32>,
    /// Steps a speculative round or a batched step produced, not yet handed out.
    pub ready: VecDeque<Step>,
    pub draft: DraftStats,
    pub auto_loops: DepthStats,
    pub output: Vec<u32>,
    pub finish: Option<FinishReason>,
}

impl SeqState {
    pub fn new(cache: KvCache, sampler: Sampler, prompt: Vec<u32>) -> Self {
        Self {
            cache,
            sampler,
            prompt,
            pos: 0,
            pending: None,
            ready: VecDeque::new(),
            draft: DraftStats::default(),
            auto_loops: DepthStats::default(),
            output: Vec::new(),
            finish: None,
        }
    }

    /// Tokens the sequence may still emit.
    pub fn remaining(&self) -> usize {
        self.sampler.params().max_tokens - self.output.len()
    }

    /// A plain pass fed `fed` tokens (the pending one, or a piece of the prompt) through every loop; `logits` are
    /// its last row's. While prompt is left to feed the step has no token; otherwise the token is sampled and
    /// emitted.
    pub fn finish_step(&mut self, fed: usize, logits: &mut [f32]) -> Step {
        self.pending = None;
        self.pos += fed;
        if self.output.is_empty() && self.pos < self.prompt.len() {
            return Step { token: None, finish: None };
        }
        let token = self.sampler.sample(logits);
        self.emit(token)
    }

    /// A speculative round kept its first `fed` rows (from `pos`): they become part of the sequence, every later
    /// row is rolled back in every loop's cache.
    pub fn commit(&mut self, fed: usize) {
        self.pos += fed;
        self.cache.truncate(self.pos);
    }

    /// Hand out a token the target depth chose: a stop token ends the sequence (and is not output), otherwise it
    /// is output, and becomes the next token to feed unless its grammar is complete (a stop) or `max_tokens` is
    /// reached.
    pub fn emit(&mut self, token: u32) -> Step {
        if self.sampler.is_stop(token) {
            self.finish = Some(FinishReason::Stop);
            return Step { token: None, finish: self.finish };
        }
        self.sampler.accept(token);
        self.output.push(token);
        if self.sampler.grammar_complete() {
            self.finish = Some(FinishReason::Stop);
        } else if self.output.len() >= self.sampler.params().max_tokens {
            self.finish = Some(FinishReason::Length);
        } else {
            self.pending = Some(token);
        }
        Step { token: Some(token), finish: self.finish }
    }
}
