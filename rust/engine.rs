//! Plain generation: prefill the prompt, then one token per step at a fixed loop depth.
//! `Generator` is the per-request state machine; `generate` drives it to the end, `step` lets a caller stream.

use std::collections::VecDeque;
use std::path::Path;
use std::sync::Arc;

use crate::ensure_arg;
use crate::error::{Error, Result};
use crate::kv::{KvCache, KvKind};
use crate::loader::{self, Config, MAX_LOOPS};
use crate::model::{LogitRows, Model, SeqChunk};
use crate::sampler::{Sampler, SamplingParams};
pub use crate::spec::{DraftStats, SpecConfig};
use crate::tokenizer::Tokenizer;

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

pub struct Engine {
    pub model: Model,
    pub tokenizer: Tokenizer,
    /// "fp16" | "int8" | "int4" | "int2" | "mixed", from the file's tensor types.
    pub quant: String,
    /// Longest sequence (prompt + output) a request may use.
    pub max_seq_len: usize,
    /// "fp16", "int8", "int4" or "int4-h" (the API's names).
    pub kv_cache_mode: String,
}

/// KV-cache modes by the API's names; `default` is the "fp16" kind for the model (f32 for all-F32 weights).
pub fn kv_kind_for_mode(mode: &str, default: KvKind, head_dim: usize) -> Result<KvKind> {
    match mode {
        "fp16" => Ok(default),
        "int8" => Ok(KvKind::Int8),
        "int4" => Ok(KvKind::Int4),
        "int4-h" if head_dim.is_power_of_two() => Ok(KvKind::Int4H),
        "int4-h" => Err(Error::InvalidArgument(format!(
            "KV cache mode \"int4-h\" needs a power-of-two head_dim for its Hadamard rotation; this model's is {head_dim}"))),
        other => Err(Error::InvalidArgument(format!(
            "unknown KV cache mode {other:?}; one of \"fp16\", \"int8\", \"int4\", \"int4-h\""))),
    }
}

/// Prompt rows a windowed sequence prefills per pass (bounds the positions one write adds to its cache).
pub const WINDOW_PREFILL_CHUNK: usize = 64;

/// Positions a sequence with window `w` keeps at a time: the window, the rollback slack, and the most rows one
/// pass may add (a prefill chunk, or a speculative tree's staged rows).
pub fn window_capacity(w: usize) -> usize {
    w + crate::kv::WINDOW_SLACK + WINDOW_PREFILL_CHUNK + crate::spec::MAX_TREE_ROWS + 1
}

impl Engine {
    pub fn load(path: &Path, max_seq_len: Option<usize>) -> Result<Self> {
        Self::load_with_kv(path, max_seq_len, "fp16")
    }

    pub fn load_with_kv(path: &Path, max_seq_len: Option<usize>, kv_cache_mode: &str) -> Result<Self> {
        let file = loader::load(path)?;
        let tokenizer = Tokenizer::from_vocab(&file.vocab).map_err(|e| Error::Format {
            path: path.to_path_buf(),
            what: "tokenizer.ggml.tokens/merges".into(),
            reason: e.to_string(),
        })?;
        let quant = file.quant.clone();
        let max_seq_len = max_seq_len.unwrap_or(file.config.context_length);
        ensure_arg!(max_seq_len >= 1, "max_seq_len must be >= 1");
        let mut model = Model::new(file)?;
        let kind = kv_kind_for_mode(kv_cache_mode, model.kv_kind(), model.cfg.head_dim)?;
        model.set_kv_kind(kind);
        Ok(Self { model, tokenizer, quant, max_seq_len, kv_cache_mode: kv_cache_mode.to_string() })
    }

    pub fn config(&self) -> &Config {
        &self.model.cfg
    }

    /// Score `ids` in one pass, reading the head after each loop depth in `depths` (ascending, 1-based): for every
    /// depth, the log-probability of `ids[i+1]` given `ids[..=i]` and the argmax prediction, for i < len-1.
    pub fn score(&self, ids: &[u32], depths: &[usize]) -> Result<Vec<(Vec<f32>, Vec<u32>)>> {
        ensure_arg!(ids.len() >= 2, "scoring needs at least two tokens");
        ensure_arg!(ids.len() <= self.max_seq_len, "{} tokens exceed max_seq_len {}", ids.len(), self.max_seq_len);
        ensure_arg!(
            !depths.is_empty() && depths.windows(2).all(|w| w[0] < w[1]),
            "depths must be ascending and non-empty"
        );
        ensure_arg!(depths[0] >= 1 && depths[depths.len() - 1] <= MAX_LOOPS, "depths must be in 1..={MAX_LOOPS}");
        let mut cache = self.model.new_cache(ids.len());
        let inputs = &ids[..ids.len() - 1];
        let targets = candle_core::Tensor::new(&ids[1..], &candle_core::Device::Cpu)?.unsqueeze(1)?;
        let mut h = self.model.embed(inputs)?;
        let mut done = 0;
        let mut out = Vec::with_capacity(depths.len());
        for &d in depths {
            let mut seqs = [SeqChunk { cache: &mut cache, pos: 0, tokens: inputs, tree: None }];
            h = self.model.run(h, &mut seqs, done == 0, done..d)?;
            done = d;
            let logits = self.model.logits(&h)?;
            let logp = candle_nn::ops::log_softmax(&logits, candle_core::D::Minus1)?;
            let picked = logp.gather(&targets, 1)?.squeeze(1)?.to_vec1::<f32>()?;
            let argmax = logits.argmax(candle_core::D::Minus1)?.to_vec1::<u32>()?;
            out.push((picked, argmax));
        }
        Ok(out)
    }
}

/// One request's generation state. Holds the engine through an `Arc` so it can outlive the caller's borrow
/// (the Python stream object owns one).
pub struct Generator {
    pub(crate) engine: Arc<Engine>,
    pub(crate) cache: KvCache,
    pub(crate) sampler: Sampler,
    /// Depth of every emitted token (verify_loops when drafting).
    pub(crate) loops: usize,
    pub(crate) prompt: Vec<u32>,
    /// Positions whose K/V are complete at every loop (prompt + fed output).
    pub(crate) pos: usize,
    /// The last emitted token, not yet fed to the model.
    pub(crate) pending: Option<u32>,
    /// Self-speculative drafting, when on (rust/spec.rs).
    pub(crate) spec: Option<SpecConfig>,
    /// Steps a speculative round verified, not yet handed out.
    pub(crate) ready: VecDeque<Step>,
    pub draft: DraftStats,
    pub output: Vec<u32>,
    pub finish: Option<FinishReason>,
}

impl Generator {
    /// `window > 0` limits attention to the last `window` positions and bounds the cache by it (`cache_window`).
    pub fn new(
        engine: Arc<Engine>,
        prompt: Vec<u32>,
        params: SamplingParams,
        loops: Option<usize>,
        window: usize,
    ) -> Result<Self> {
        let loops = loops.unwrap_or(engine.config().default_loops);
        ensure_arg!((1..=MAX_LOOPS).contains(&loops), "loops must be in 1..={MAX_LOOPS}, got {loops}");
        ensure_arg!(!prompt.is_empty(), "the prompt must contain at least one token");
        let vocab = engine.config().vocab_size;
        if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::InvalidArgument(format!(
                "prompt token id {bad} is outside the {vocab}-token vocabulary"
            )));
        }
        let needed = prompt.len() + params.max_tokens;
        if needed > engine.max_seq_len {
            return Err(Error::ContextLength { needed, limit: engine.max_seq_len });
        }
        let sampler = Sampler::new(params, &prompt, vocab, engine.tokenizer.eos_token_id)?;
        // `needed` leaves one spare position (the last output token is never fed back); tree verification may
        // stage up to MAX_TREE_ROWS candidate rows beyond the path before compacting them.
        let full = needed + crate::spec::MAX_TREE_ROWS;
        let cache = match window {
            0 => engine.model.new_cache(full),
            w => engine.model.new_cache(full.min(window_capacity(w))).with_window(w),
        };
        Ok(Self {
            engine,
            cache,
            sampler,
            loops,
            prompt,
            pos: 0,
            pending: None,
            spec: None,
            ready: VecDeque::new(),
            draft: DraftStats::default(),
            output: Vec::new(),
            finish: None,
        })
    }

    pub fn prompt_len(&self) -> usize {
        self.prompt.len()
    }

    pub fn kv_bytes(&self) -> usize {
        self.cache.bytes_in_use()
    }

    /// Advance by one token. After a step with `finish` set, further steps return `finish` again and do nothing.
    pub fn step(&mut self) -> Result<Step> {
        if let Some(step) = self.ready.pop_front() {
            return Ok(step);
        }
        if let Some(f) = self.finish {
            return Ok(Step { token: None, finish: Some(f) });
        }
        if let (Some(cfg), Some(_)) = (self.spec, self.pending) {
            self.speculative_round(cfg)?;
            return self.ready.pop_front().ok_or_else(|| Error::Internal("a speculative round emitted nothing".into()));
        }
        let feed: Vec<u32> = match self.pending.take() {
            Some(t) => vec![t],
            None => self.prompt[self.pos..].to_vec(), // all of it, or what batched steps have not fed yet
        };
        // A windowed cache holds a bounded number of positions, so its prompt goes in chunks.
        let chunk = if self.cache.window() > 0 { WINDOW_PREFILL_CHUNK } else { feed.len() };
        let mut logits = None;
        for part in feed.chunks(chunk) {
            let mut seqs = [SeqChunk { cache: &mut self.cache, pos: self.pos, tokens: part, tree: None }];
            logits = Some(self.engine.model.forward(&mut seqs, self.loops, LogitRows::Last)?);
            self.pos += part.len();
        }
        let logits = logits.ok_or_else(|| Error::Internal("nothing to feed".into()))?;
        let mut logits = logits.flatten_all()?.to_vec1::<f32>()?;
        let token = self.sampler.sample(&mut logits);
        Ok(self.emit(token))
    }

    /// Hand out a token the target depth chose: a stop token ends the sequence (and is not output), otherwise it
    /// is output, and becomes the next token to feed unless `max_tokens` is reached.
    pub(crate) fn emit(&mut self, token: u32) -> Step {
        if self.sampler.is_stop(token) {
            self.finish = Some(FinishReason::Stop);
            return Step { token: None, finish: self.finish };
        }
        self.sampler.accept(token);
        self.output.push(token);
        if self.output.len() >= self.sampler.params().max_tokens {
            self.finish = Some(FinishReason::Length);
        } else {
            self.pending = Some(token);
        }
        Step { token: Some(token), finish: self.finish }
    }

    /// Run to the end; returns the finish reason.
    pub fn run(&mut self) -> Result<FinishReason> {
        loop {
            if let Some(f) = self.step()?.finish {
                return Ok(f);
            }
        }
    }
}
