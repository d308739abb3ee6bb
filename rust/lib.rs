//! tinyloop: an inference engine for weight-shared looped transformer language models.
//!
//! `loader` reads the `.tinyloop` (GGUF) file, `tokenizer` is GPT-2 byte-level BPE, `model` is the candle forward
//! pass, `kv` the cache and attention kernel, `sampler` turns logits into tokens, `engine` generates. `py` (feature
//! `python`) is the only place that knows about Python.

#[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
pub mod attn_f16;
pub mod batch;
pub mod draft_head;
pub mod engine;
pub mod error;
pub mod kv;
pub mod kv_elem;
pub mod linear;
pub mod loader;
pub mod model;
pub(crate) mod panels;
pub mod sampler;
pub mod simd;
pub mod spec;
pub mod tokenizer;
pub mod tree;
#[cfg(vnni)]
pub mod vnni;

#[cfg(feature = "python")]
mod py;

pub use engine::{Engine, FinishReason, Generator, Step};
pub use error::{Error, Result};
pub use sampler::SamplingParams;
