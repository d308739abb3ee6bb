//! tinyloop: an inference engine for weight-shared looped transformer language models.
//!
//! Layers, bottom up: `allocator` (mimalloc as the global allocator), `error` and `limits` (every bound, in one
//! place); `kernels` (panel matmuls, f16 attention, vector math); `kv` (the cache and attention over it); `model`
//! (config, layers, RoPE, the forward pass); `loader` (the `.tinyloop` GGUF file, docs/format.md); `tokenizer`
//! (GPT-2 byte-level BPE); `grammar` (JSON schema / Lark / regex to token masks, through llguidance); `sampler`
//! (logits to tokens); `profile` (wall time per stage of a step); `probe` (read bandwidth, for the benches); `generate` (`Engine`, `Generation`, `Generator`: plain,
//! speculative and batched generation, docs/engine.md).
//! `py` (feature `python`) is the only place that knows about Python. No module imports one that imports it back
//! (`scripts/rust-imports.py` checks).

pub mod allocator;
pub mod error;
pub mod generate;
pub mod grammar;
pub mod kernels;
pub mod kv;
pub mod limits;
pub mod loader;
pub mod model;
pub mod probe;
pub mod profile;
pub mod sampler;
pub mod tokenizer;

#[cfg(feature = "python")]
mod py;

pub use error::{Error, Result};
pub use generate::{Engine, FinishReason, Generation, Generator, Speculative, Step};
pub use sampler::SamplingParams;
