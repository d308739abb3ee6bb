//! Grammar-constrained sampling through llguidance: a JSON schema, a Lark grammar or a regular expression becomes,
//! at every step, the set of tokens that keep the output inside the grammar; the sampler sets every other logit
//! to −∞ before it chooses (`Sampler::process`).
//!
//! One `Grammars` per engine holds the vocabulary's token trie and llguidance's parser factory, built on the first
//! constrained request (tens of milliseconds for a 50k vocabulary). Each request gets its own `Constraint` — a
//! matcher that advances by the tokens the request emits. A speculative round advances it by its drafts too, so
//! each draft is drawn under the grammar, then rewinds them all before verification re-advances it token by token;
//! greedy speculative output therefore stays equal to plain output under a grammar.

mod ahead;
mod vocab;

use std::sync::{Arc, OnceLock};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv};
use llguidance::{Matcher, ParserFactory};

use self::ahead::{Lookahead, Mask, Workers};
use crate::error::{Error, Result};
use crate::tokenizer::Tokenizer;

/// What a request's output must match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Grammar {
    /// A JSON schema (as JSON text); the output is one JSON value it accepts.
    JsonSchema(String),
    /// A grammar in llguidance's Lark dialect.
    Lark(String),
    /// A regular expression the whole output matches.
    Regex(String),
}

impl Grammar {
    fn top_level(&self) -> Result<TopLevelGrammar> {
        Ok(match self {
            Grammar::JsonSchema(text) => {
                let mut schema: serde_json::Value = serde_json::from_str(text)
                    .map_err(|e| Error::InvalidArgument(format!("grammar: the JSON schema is not JSON: {e}")))?;
                // Fixed separators, as `json.dumps` writes them, unless the schema says otherwise (`x-guidance`): a
                // small model offered free whitespace between tokens can spend its whole budget on newlines.
                if let Some(obj) = schema.as_object_mut() {
                    obj.entry("x-guidance").or_insert_with(|| {
                        serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
                    });
                }
                TopLevelGrammar::from_json_schema(schema)
            }
            Grammar::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
            Grammar::Regex(rx) => TopLevelGrammar::from_regex(rx),
        })
    }
}

/// The engine's grammar compiler, built when first needed.
pub struct Grammars {
    tokenizer: Arc<Tokenizer>,
    vocab_size: usize,
    factory: OnceLock<std::result::Result<ParserFactory, String>>,
    /// How many threads compute masks ahead (`ahead.rs`; 0: each mask is computed when it is needed).
    threads: usize,
    workers: OnceLock<Workers>,
}

impl Grammars {
    pub fn new(tokenizer: Arc<Tokenizer>, vocab_size: usize) -> Self {
        let threads = ahead::default_threads();
        Self { tokenizer, vocab_size, factory: OnceLock::new(), threads, workers: OnceLock::new() }
    }

    /// Set the number of grammar threads, before the first constrained request starts them.
    pub fn set_threads(&mut self, threads: usize) {
        self.threads = threads;
        self.workers = OnceLock::new();
    }

    fn factory(&self) -> Result<&ParserFactory> {
        let built = self.factory.get_or_init(|| {
            let env: TokEnv = Arc::new(vocab::Vocab::new(self.tokenizer.clone(), self.vocab_size));
            let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
            factory.quiet();
            Ok(factory)
        });
        built.as_ref().map_err(|e| Error::Internal(format!("grammar support could not start: {e}")))
    }

    /// Compile `grammar` for one request. A grammar llguidance cannot compile (a JSON schema keyword outside the
    /// supported subset, a malformed Lark rule, a grammar past the parser's size limits) is an invalid argument
    /// whose message names the cause.
    pub fn compile(&self, grammar: &Grammar) -> Result<Constraint> {
        let parser = self
            .factory()?
            .create_parser(grammar.top_level()?)
            .map_err(|e| Error::InvalidArgument(format!("grammar: {e}")))?;
        let workers = self.workers.get_or_init(|| Workers::new(self.threads)).clone();
        Ok(Constraint::new(Matcher::new(Ok(parser)), workers))
    }
}

/// One request's grammar state.
pub struct Constraint {
    /// The matcher is either here or away computing its next mask (`ahead.rs`); exactly one of the two is set.
    here: Option<Box<Matcher>>,
    away: Option<Arc<Lookahead>>,
    workers: Workers,
    /// The mask for the matcher's present state, once known.
    next: Option<Mask>,
    /// The mask at the start of a speculative round, kept while drafts advance the matcher; the rewind restores it.
    round: Option<Mask>,
    /// The grammar accepts the output so far and allows nothing more.
    stopped: bool,
    /// Draft tokens advanced into the matcher this round, undone by `rewind_drafts`.
    drafted: usize,
    /// False once a draft left the grammar (or ended the text): later drafts of the round are drawn unmasked —
    /// verification rejects the first bad one anyway.
    drafting: bool,
    /// Why the matcher failed (a parser limit reached mid-output); the request then ends with this error.
    error: Option<String>,
}

impl Constraint {
    fn new(matcher: Matcher, workers: Workers) -> Self {
        let mut c = Self {
            here: Some(Box::new(matcher)),
            away: None,
            workers,
            next: None,
            round: None,
            stopped: false,
            drafted: 0,
            drafting: true,
            error: None,
        };
        c.look_ahead(); // the first mask is computed during the prompt's prefill
        c
    }

    /// The matcher, back from computing its next mask (`want_mask`: compute it here if no grammar thread has).
    fn matcher(&mut self, want_mask: bool) -> &mut Matcher {
        if let Some(job) = self.away.take() {
            let (matcher, mask) = job.finish(want_mask);
            self.here = Some(matcher);
            self.next = mask;
        }
        self.here.as_mut().expect("the matcher is here when it is not away")
    }

    /// Start computing the mask for the matcher's new state while the caller runs the forward pass.
    fn look_ahead(&mut self) {
        self.next = None;
        if let Some(matcher) = self.here.take() {
            self.away = Some(self.workers.start(matcher));
        }
    }

    /// Set the logit of every token the grammar does not allow next to −∞. When the grammar is complete only EOS
    /// is allowed; if the matcher failed, only EOS is left too, and `error` says why.
    pub fn mask(&mut self, logits: &mut [f32]) {
        if !self.drafting {
            return;
        }
        self.matcher(true);
        let (here, next) = (&mut self.here, &mut self.next);
        let why = match next.get_or_insert_with(|| ahead::compute(here.as_mut().expect("the matcher is back"))) {
            Ok(mask) if !mask.is_zero() => return apply(mask, logits),
            Ok(_) => "the grammar allows no token here".to_string(),
            Err(e) => e.clone(),
        };
        apply(&self.fail(why), logits);
    }

    fn fail(&mut self, why: String) -> SimpleVob {
        self.error.get_or_insert(why);
        self.matcher(false).tok_env().map(|env| env.tok_trie().eos_token_set()).unwrap_or_default()
    }

    /// Advance by an emitted token (one the mask allowed), and start on the next mask.
    pub fn consume(&mut self, token: u32) {
        if self.error.is_some() {
            return;
        }
        let matcher = self.matcher(false);
        match matcher.consume_token(token) {
            Ok(()) => {
                self.stopped = matcher.is_stopped();
                self.look_ahead();
            }
            Err(e) => self.error = Some(e.to_string()),
        }
    }

    /// Advance tentatively by a drafted token; a token outside the grammar (possible when drafts were drawn
    /// unmasked) or one that ends the output stops the advance for the rest of the round.
    pub fn draft(&mut self, token: u32, ends_output: bool) {
        if !self.drafting || self.error.is_some() {
            return;
        }
        if ends_output {
            self.drafting = false;
            return;
        }
        let matcher = self.matcher(false);
        let consumed = matcher.try_consume_tokens(&[token]);
        let stopped = matcher.is_stopped();
        if self.drafted == 0 {
            self.round = self.next.take();
        }
        match consumed {
            Ok(1) => {
                self.drafted += 1;
                self.stopped = stopped;
                self.look_ahead();
            }
            Ok(_) => self.drafting = false,
            Err(e) => self.error = Some(e.to_string()),
        }
    }

    /// Undo this round's drafts, so verification advances the matcher by the tokens it emits.
    pub fn rewind_drafts(&mut self) {
        if self.error.is_none() && (self.drafted > 0 || self.round.is_some()) {
            let drafted = self.drafted;
            let matcher = self.matcher(false);
            match if drafted > 0 { matcher.rollback(drafted) } else { Ok(()) } {
                Ok(()) => {
                    self.stopped = matcher.is_stopped();
                    self.next = self.round.take();
                }
                Err(e) => self.error = Some(e.to_string()),
            }
        }
        self.round = None;
        self.drafted = 0;
        self.drafting = true;
    }

    /// The grammar is complete and allows nothing more: the output ends here.
    pub fn is_complete(&self) -> bool {
        self.error.is_none() && self.stopped
    }

    pub fn error(&self) -> Option<&str> {
        self.error.as_deref()
    }
}

impl Drop for Constraint {
    fn drop(&mut self) {
        if let Some(job) = &self.away {
            job.abandon();
        }
    }
}

/// −∞ for every id `allowed` does not hold (ids past the mask included).
fn apply(allowed: &SimpleVob, logits: &mut [f32]) {
    let words = allowed.as_slice();
    for (w, chunk) in logits.chunks_mut(32).enumerate() {
        let bits = words.get(w).copied().unwrap_or(0);
        if bits == u32::MAX && chunk.len() == 32 {
            continue;
        }
        for (i, l) in chunk.iter_mut().enumerate() {
            if bits >> i & 1 == 0 {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}

#[cfg(test)]
mod tests;
