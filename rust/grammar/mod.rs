//! Grammar-constrained sampling through llguidance: a JSON schema, a Lark grammar or a regular expression becomes,
//! at every step, the set of tokens that keep the output inside the grammar; the sampler sets every other logit
//! to −∞ before it chooses (`Sampler::process`).
//!
//! One `Grammars` per engine holds the vocabulary's token trie and llguidance's parser factory, built on the first
//! constrained request (tens of milliseconds for a 50k vocabulary). Each request gets its own `Constraint` — a
//! matcher that advances by the tokens the request emits. A speculative round advances it by its drafts too, so
//! each draft is drawn under the grammar, then rewinds them all before verification re-advances it token by token;
//! greedy speculative output therefore stays equal to plain output under a grammar.

mod vocab;

use std::sync::{Arc, OnceLock};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv};
use llguidance::{Matcher, ParserFactory};

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
}

impl Grammars {
    pub fn new(tokenizer: Arc<Tokenizer>, vocab_size: usize) -> Self {
        Self { tokenizer, vocab_size, factory: OnceLock::new() }
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
        Ok(Constraint { matcher: Matcher::new(Ok(parser)), drafted: 0, drafting: true, error: None })
    }
}

/// One request's grammar state.
pub struct Constraint {
    matcher: Matcher,
    /// Draft tokens advanced into the matcher this round, undone by `rewind_drafts`.
    drafted: usize,
    /// False once a draft left the grammar (or ended the text): later drafts of the round are drawn unmasked —
    /// verification rejects the first bad one anyway.
    drafting: bool,
    /// Why the matcher failed (a parser limit reached mid-output); the request then ends with this error.
    error: Option<String>,
}

impl Constraint {
    /// Set the logit of every token the grammar does not allow next to −∞. When the grammar is complete only EOS
    /// is allowed; if the matcher failed, only EOS is left too, and `error` says why.
    pub fn mask(&mut self, logits: &mut [f32]) {
        if !self.drafting {
            return;
        }
        let allowed = match self.matcher.compute_mask_or_eos() {
            Ok(mask) if !mask.is_zero() => mask,
            Ok(_) => self.fail("the grammar allows no token here".into()),
            Err(e) => self.fail(e.to_string()),
        };
        apply(&allowed, logits);
    }

    fn fail(&mut self, why: String) -> SimpleVob {
        self.error.get_or_insert(why);
        self.matcher.tok_env().map(|env| env.tok_trie().eos_token_set()).unwrap_or_default()
    }

    /// Advance by an emitted token (one the mask allowed).
    pub fn consume(&mut self, token: u32) {
        if self.error.is_none() {
            if let Err(e) = self.matcher.consume_token(token) {
                self.error = Some(e.to_string());
            }
        }
    }

    /// Advance tentatively by a drafted token; a token outside the grammar (possible when drafts were drawn
    /// unmasked) or one that ends the output stops the advance for the rest of the round.
    pub fn draft(&mut self, token: u32, ends_output: bool) {
        if !self.drafting || self.error.is_some() {
            return;
        }
        match (ends_output, self.matcher.try_consume_tokens(&[token])) {
            (false, Ok(1)) => self.drafted += 1,
            (_, Err(e)) => self.error = Some(e.to_string()),
            _ => self.drafting = false,
        }
    }

    /// Undo this round's drafts, so verification advances the matcher by the tokens it emits.
    pub fn rewind_drafts(&mut self) {
        if self.drafted > 0 && self.error.is_none() {
            if let Err(e) = self.matcher.rollback(self.drafted) {
                self.error = Some(e.to_string());
            }
        }
        self.drafted = 0;
        self.drafting = true;
    }

    /// The grammar is complete and allows nothing more: the output ends here.
    pub fn is_complete(&self) -> bool {
        self.error.is_none() && self.matcher.is_stopped()
    }

    pub fn error(&self) -> Option<&str> {
        self.error.as_deref()
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
