//! `Generator`, one request's state machine: prefill the prompt, then one token per step at a fixed loop depth, or
//! a speculative round (`chain.rs`, `tree.rs`) whenever no verified token is waiting. `step` advances one
//! generator; `step_batch` advances many together through the batch scheduler (`batch.rs`).

use std::sync::Arc;

use super::batch::{self, Member, Work};
use super::engine::Engine;
use super::plan::{Generation, Speculative};
use super::seq::{DepthStats, DraftStats, FinishReason, SeqState, Step};
use super::tree;
use crate::ensure_arg;
use crate::error::{Error, Result};
use crate::kv::PrefixKey;
use crate::limits::{MAX_TREE_ROWS, PREFILL_CHUNK, WINDOW_PREFILL_CHUNK, WINDOW_SLACK};
use crate::model::{AutoDepth, LogitRows, SeqChunk};
use crate::profile::{self, Stage};
use crate::sampler::{Sampler, TokenLogprob};

/// Positions a sequence with window `w` keeps at a time: the window, the rollback slack, and the most rows one
/// pass may add (a prefill chunk, or a speculative tree's staged rows).
fn window_capacity(w: usize) -> usize {
    w + WINDOW_SLACK + WINDOW_PREFILL_CHUNK + MAX_TREE_ROWS + 1
}

/// One request's generation state. Holds the engine through an `Arc` so it can outlive the caller's borrow
/// (the Python stream object owns one).
pub struct Generator {
    engine: Arc<Engine>,
    /// Depth of every emitted token (verify_loops when drafting).
    loops: usize,
    /// Self-speculative decoding, when on.
    spec: Option<Speculative>,
    /// Adaptive depth up to `loops`, when on.
    auto: Option<AutoDepth>,
    seq: SeqState,
    /// What the prompt cache keys this sequence's KV by.
    key: PrefixKey,
    /// Prompt tokens whose KV came from the prompt cache.
    cached: usize,
    /// Whether the prompt cache was consulted (at the first step).
    looked_up: bool,
    /// Whether this sequence's KV was offered to the prompt cache (once, when it finishes or is dropped).
    offered: bool,
}

/// What a generator does in a batched step.
enum Next {
    /// Already known: a verified speculative token waiting, or the end.
    Done(Result<Step>),
    /// Joins the batch of its (engine, depth) with this work.
    Batch((usize, usize), Work),
    /// Runs its own step (tree round, windowed prefill).
    Solo,
}

/// What the device path does not run yet, refused by name on an engine that computes on a device.
fn device_supports(engine: &Engine, generation: &Generation) -> Result<()> {
    let compute = engine.model.compute();
    if !compute.on_device() {
        return Ok(());
    }
    let device = compute.name();
    ensure_arg!(
        generation.speculative.is_none_or(|s| s.k_branches == 1),
        "tree speculative decoding (K_branches > 1) is not available on device {device:?} yet; chain mode \
         (K_branches 1) is"
    );
    ensure_arg!(
        generation.cache_window == 0,
        "cache_window (a sliding KV window) is not available on device {device:?} yet; leave it 0"
    );
    Ok(())
}

impl Generator {
    /// Validate `generation` (every argument check of a request happens here) and set up its cache and sampler.
    pub fn new(engine: Arc<Engine>, prompt: Vec<u32>, generation: Generation) -> Result<Self> {
        generation.validate()?;
        let loops = generation.depth(engine.config().default_loops);
        ensure_arg!(!prompt.is_empty(), "the prompt must contain at least one token");
        engine.check_tokens(&prompt, "prompt token id")?;
        ensure_arg!(
            generation.speculative.is_none() || !engine.model.kv_share(),
            "speculative decoding verifies drafts against every loop's KV; this engine shares the last loop's \
             (kv_share=\"last\"): leave draft settings out"
        );
        ensure_arg!(
            generation.speculative.is_none() || generation.auto.is_none() || !engine.model.exit_gated(),
            "with loops \"auto\", this model's exit gate decides each token's depth from its first loop on, which \
             drafts skip: leave draft settings out"
        );
        device_supports(&engine, &generation)?;
        let constraint = generation.grammar.as_ref().map(|g| engine.grammars.compile(g)).transpose()?;
        let Generation { params, speculative, cache_window, auto, .. } = generation;
        let needed = prompt.len() + params.max_tokens;
        if needed > engine.max_seq_len {
            return Err(Error::ContextLength { needed, limit: engine.max_seq_len });
        }
        let sampler = Sampler::new(params, &prompt, engine.config().vocab_size, &engine.tokenizer.end_ids)
            .constrained(constraint);
        // `needed` leaves one spare position (the last output token is never fed back); tree verification may
        // stage up to MAX_TREE_ROWS candidate rows beyond the path before compacting them.
        let full = needed + MAX_TREE_ROWS;
        let capacity = if cache_window == 0 { full } else { full.min(window_capacity(cache_window)) };
        let cache = engine.model.new_cache(capacity).with_window(cache_window);
        let key = PrefixKey { loops, window: cache_window };
        let seq = SeqState::new(cache, sampler, prompt);
        Ok(Self { engine, loops, spec: speculative, auto, seq, key, cached: 0, looked_up: false, offered: false })
    }

    /// Before the first step: start from the prompt cache's longest prefix of the prompt, if it has one. Done at the
    /// first step rather than at creation, so that a request queued right behind the previous turn of its
    /// conversation finds that turn's KV (the server's engine thread releases finished requests before stepping).
    fn restore_prefix(&mut self) {
        if std::mem::replace(&mut self.looked_up, true) || self.seq.pos > 0 {
            return;
        }
        let (capacity, window) = (self.seq.cache.capacity(), self.seq.cache.window());
        if let Some(reused) = self.engine.prefixes.lookup(self.key, &self.seq.prompt, capacity, window) {
            (self.seq.cache, self.seq.pos, self.cached) = (reused.cache, reused.tokens, reused.tokens);
        }
    }

    /// Prompt tokens whose KV came from the prompt cache (they were not prefilled).
    pub fn cached_tokens(&self) -> usize {
        self.cached
    }

    /// Offer the positions fed so far to the prompt cache, once: when the sequence finishes, or when it is dropped
    /// unfinished (a cancelled request's prompt is as reusable as a finished one's). Under adaptive depth only the
    /// prompt's positions (which ran every loop) are offered: the output's depend on the exit rule too.
    fn keep_prefix(&mut self) {
        if self.offered {
            return;
        }
        self.offered = true;
        let seq = &self.seq;
        let fed = if self.auto.is_some() { seq.pos.min(seq.prompt.len()) } else { seq.pos };
        let tokens: Vec<u32> = seq.prompt.iter().chain(&seq.output).copied().take(fed).collect();
        self.engine.prefixes.offer(self.key, tokens, &seq.cache);
    }

    /// The request is over (finished or abandoned): offer its KV to the prompt cache and free it.
    pub fn release(&mut self) {
        self.keep_prefix();
        let empty = self.engine.model.new_cache(0);
        self.seq.cache = empty;
    }

    /// After a step: once the prompt is in, a cache that shares loops keeps only the last loop's KV; a finished
    /// sequence's KV goes to the prompt cache; a failed one's is never offered.
    fn settled(&mut self, step: Result<Step>) -> Result<Step> {
        if self.seq.pos >= self.seq.prompt.len() {
            self.seq.cache.collapse(self.loops); // the prompt is in: from here on, loops share the last one's KV
        }
        match &step {
            Ok(Step { finish: Some(_), .. }) => self.keep_prefix(),
            Err(_) => self.offered = true,
            Ok(_) => {}
        }
        step
    }

    pub fn prompt_len(&self) -> usize {
        self.seq.prompt.len()
    }

    pub fn kv_bytes(&self) -> usize {
        self.seq.cache.bytes_in_use()
    }

    /// The loop depth every token is chosen at: the requested `loops` (the model's default when unset), or
    /// `verify_loops` when speculative.
    pub fn loops(&self) -> usize {
        self.loops
    }

    /// The tokens emitted so far.
    pub fn output(&self) -> &[u32] {
        &self.seq.output
    }

    /// Their log-probabilities, one per emitted token, when the sampling parameters ask (else empty).
    pub fn logprobs(&self) -> &[TokenLogprob] {
        self.seq.sampler.logprobs()
    }

    pub fn wants_logprobs(&self) -> bool {
        self.seq.sampler.params().logprobs.is_some()
    }

    /// Loops run by the tokens adaptive depth decided so far (zeros unless `loops: "auto"`; the first output token
    /// comes from the prompt's last row, which runs every loop, and is not counted).
    pub fn auto_loops(&self) -> DepthStats {
        self.seq.auto_loops
    }

    /// Draft counters so far (zeros unless speculative).
    pub fn draft(&self) -> DraftStats {
        self.seq.draft
    }

    pub fn finish(&self) -> Option<FinishReason> {
        self.seq.finish
    }

    /// Advance by one token. After a step with `finish` set, further steps return `finish` again and do nothing.
    pub fn step(&mut self) -> Result<Step> {
        let step = profile::time(Stage::Step, || self.advance());
        self.settled(step)
    }

    /// `step`, untimed (a batched step times itself as a whole).
    fn advance(&mut self) -> Result<Step> {
        self.restore_prefix();
        if let Some(step) = self.seq.ready.pop_front() {
            return self.checked(step);
        }
        if let Some(f) = self.seq.finish {
            return self.checked(Step { token: None, finish: Some(f) });
        }
        if let (Some(spec), Some(_)) = (self.spec, self.seq.pending) {
            self.speculative_round(spec)?;
            return self.take_ready("a speculative round emitted nothing");
        }
        if let (Some(rule), Some(token)) = (self.auto, self.seq.pending) {
            let member = Member { seq: &mut self.seq, work: Work::Auto(token, rule) };
            batch::run_group(&self.engine.model, self.loops, &mut [member])?;
            return self.take_ready("an adaptive step emitted nothing");
        }
        let seq = &mut self.seq;
        let feed: Vec<u32> = match seq.pending {
            Some(t) => vec![t],
            None => seq.prompt[seq.pos..].to_vec(), // all of it, or what batched steps have not fed yet
        };
        // A windowed cache holds a bounded number of positions, so its prompt goes in chunks.
        let chunk = if seq.cache.window() > 0 { WINDOW_PREFILL_CHUNK } else { feed.len() };
        let (mut at, mut logits) = (seq.pos, None);
        for part in feed.chunks(chunk) {
            let mut seqs = [SeqChunk { cache: &mut seq.cache, pos: at, tokens: part, tree: None, exits: None }];
            logits = Some(self.engine.model.forward(&mut seqs, self.loops, LogitRows::Last)?);
            at += part.len();
        }
        let logits = logits.ok_or_else(|| Error::Internal("nothing to feed".into()))?;
        let mut logits = logits.flatten_all()?.to_vec1::<f32>()?;
        let step = profile::time(Stage::Sample, || seq.finish_step(feed.len(), &mut logits));
        self.checked(step)
    }

    /// A step as handed out — unless the request's grammar failed while choosing it (a parser limit reached
    /// mid-output): then the request fails with the grammar's reason.
    fn checked(&self, step: Step) -> Result<Step> {
        match self.seq.sampler.grammar_error() {
            Some(why) => Err(Error::Internal(format!("grammar: {why}"))),
            None => Ok(step),
        }
    }

    /// The next queued step, checked; `missing` explains an empty queue.
    fn take_ready(&mut self, missing: &str) -> Result<Step> {
        let step = self.seq.ready.pop_front().ok_or_else(|| Error::Internal(missing.into()))?;
        self.checked(step)
    }

    /// Run to the end; returns the finish reason.
    pub fn run(&mut self) -> Result<FinishReason> {
        loop {
            if let Some(f) = self.step()?.finish {
                return Ok(f);
            }
        }
    }

    /// One draft + verify round; queues the verified steps. Chain rounds run through the batch scheduler, here as a
    /// batch of one.
    fn speculative_round(&mut self, spec: Speculative) -> Result<()> {
        let model = &self.engine.model;
        if spec.k_branches > 1 {
            return tree::round(model, &mut self.seq, spec);
        }
        let work = Work::Chain(spec, self.auto);
        batch::run_group(model, self.loops, &mut [Member { seq: &mut self.seq, work }])
    }

    /// This generator's part in a batched step.
    fn next(&mut self) -> Next {
        self.restore_prefix();
        if let Some(step) = self.seq.ready.pop_front() {
            return Next::Done(self.checked(step));
        }
        if let Some(f) = self.seq.finish {
            return Next::Done(self.checked(Step { token: None, finish: Some(f) }));
        }
        let seq = &mut self.seq;
        let key = (Arc::as_ptr(&self.engine) as usize, self.loops);
        match (seq.pending, self.spec) {
            (Some(_), Some(spec)) if spec.k_branches > 1 => Next::Solo,
            (Some(_), Some(spec)) => Next::Batch(key, Work::Chain(spec, self.auto)),
            (Some(t), None) => match self.auto {
                Some(rule) => Next::Batch(key, Work::Auto(t, rule)),
                None => Next::Batch(key, Work::Plain(vec![t])),
            },
            (None, _) if seq.cache.window() > 0 => Next::Solo,
            (None, _) => {
                let chunk = seq.prompt[seq.pos..(seq.pos + PREFILL_CHUNK).min(seq.prompt.len())].to_vec();
                Next::Batch(key, Work::Plain(chunk))
            }
        }
    }
}

/// Advance every generator by one step — for each, what `Generator::step` alone would produce. A failure is
/// reported for the generator it concerns; the others go on.
pub fn step_batch(gens: &mut [&mut Generator]) -> Vec<Result<Step>> {
    let steps = profile::time(Stage::Step, || batch_step(gens));
    gens.iter_mut().zip(steps).map(|(g, step)| g.settled(step)).collect()
}

impl Drop for Generator {
    fn drop(&mut self) {
        self.keep_prefix();
    }
}

fn batch_step(gens: &mut [&mut Generator]) -> Vec<Result<Step>> {
    let mut plans: Vec<Next> = gens.iter_mut().map(|g| g.next()).collect();
    let mut out: Vec<Option<Result<Step>>> = (0..gens.len()).map(|_| None).collect();
    let mut keys: Vec<(usize, usize)> =
        plans.iter().filter_map(|p| if let Next::Batch(k, _) = p { Some(*k) } else { None }).collect();
    keys.sort_unstable();
    keys.dedup();
    for key in keys {
        let mut engine = None;
        let (idx, mut members): (Vec<usize>, Vec<Member>) = gens
            .iter_mut()
            .zip(plans.iter_mut())
            .enumerate()
            .filter_map(|(i, (g, p))| match p {
                Next::Batch(k, _) if *k == key => match std::mem::replace(p, Next::Solo) {
                    Next::Batch(_, work) => {
                        engine.get_or_insert_with(|| g.engine.clone());
                        Some((i, Member { seq: &mut g.seq, work }))
                    }
                    _ => None,
                },
                _ => None,
            })
            .unzip();
        let Some(engine) = engine else { continue };
        let ran = batch::run_group(&engine.model, key.1, &mut members);
        drop(members);
        for i in idx {
            out[i] = Some(match ran {
                // Nothing was emitted: each one runs alone, so an error lands on the request that caused it.
                Err(_) => gens[i].advance(),
                Ok(()) => gens[i].take_ready("a batched step produced nothing"),
            });
        }
    }
    for (i, (g, plan)) in gens.iter_mut().zip(plans).enumerate() {
        match plan {
            Next::Done(step) => out[i] = Some(step),
            Next::Solo if out[i].is_none() => out[i] = Some(g.advance()),
            _ => {}
        }
    }
    out.into_iter().map(|r| r.unwrap_or_else(|| Err(Error::Internal("a generator was not stepped".into())))).collect()
}
