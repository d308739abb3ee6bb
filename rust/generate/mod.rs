//! Generation. `Engine` is a loaded model with its tokenizer; `Generation` says what one request generates
//! (sampling, loop depth, speculative mode, window) and is validated once, by `Generator::new`; `Generator` is the
//! request's state machine — `step` streams, `run` drives it to the end, `step_batch` steps many together.
//!
//! Files: `engine.rs`, `plan.rs` (`Generation`, `Speculative`), `generator.rs` (`Generator`), `seq.rs` (the state
//! a step works on, and `finish_step`), and the generator's parts: `chain.rs` (chain-speculative rounds),
//! `tree.rs` (tree rounds), `batch.rs` (the passes of a batched step).

mod batch;
mod chain;
mod engine;
mod generator;
mod plan;
mod seq;
#[cfg(test)]
mod tests;
mod tree;

pub use engine::{kv_kind_for_mode, Engine, PromptCache};
pub use generator::{step_batch, Generator};
pub use plan::{Generation, Speculative};
pub use seq::{DraftStats, FinishReason, Step};
