//! A head over listed rows of the output head: the model's most frequent tokens, where a full distribution is not
//! needed.
//!
//! On a small looped model the 50,257-row head costs as much as many loops. A file may list two such vocabularies,
//! both written by `tinyloop draft-vocab` from a corpus:
//!
//! - the **draft vocabulary** (`tinyloop.draft.token_ids`): speculative drafts take their logits from those rows
//!   alone, with every other token at −∞. Only proposals change: the verifier always reads the full head, so greedy
//!   output is still plain generation's, token for token, and sampled output keeps plain sampling's distribution
//!   (the speculative-sampling rule only needs q to be the distribution the draft was drawn from, which it is). A
//!   token outside the list is never drafted; its position is then corrected by the verifier, as any rejected draft
//!   is.
//! - the **exit vocabulary** (`tinyloop.exit.token_ids`): adaptive depth's settling rule compares successive loops'
//!   distributions over those rows (`exit.rs`). The comparison only decides how many loops a token runs; the token
//!   itself is chosen from the full head at its exit loop.

use std::sync::Arc;

use candle_core::quantized::ggml_file::qtensor_from_ggml;
use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};

use super::compute::Compute;
use super::linear::Linear;
use crate::error::{Error, Result};

/// The token lists a file gives for row heads, each optional: the draft and the exit vocabulary.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HeadRows {
    pub draft: Option<Vec<u32>>,
    pub exit: Option<Vec<u32>>,
}

pub struct RowHead {
    /// Vocabulary ids of the rows, ascending.
    ids: Vec<u32>,
    head: Linear,
}

impl RowHead {
    /// Rows `ids` of the (possibly padded) head tensor, in the head's own storage type, where `compute` runs.
    pub fn new(head: &QTensor, ids: &[u32], vocab_size: usize, compute: &Compute) -> Result<Self> {
        let mut ids = ids.to_vec();
        ids.sort_unstable();
        ids.dedup();
        if ids.is_empty() || ids.last().is_some_and(|&t| t as usize >= vocab_size) {
            return Err(Error::Internal(format!("a head's token list must be non-empty ids below {vocab_size}")));
        }
        let (rows, cols) = head.shape().dims2()?;
        let raw = head.data()?;
        let row_bytes = raw.len() / rows;
        let mut picked = Vec::with_capacity(ids.len() * row_bytes);
        for &t in &ids {
            let r = t as usize * row_bytes;
            picked.extend_from_slice(&raw[r..r + row_bytes]);
        }
        let t = qtensor_from_ggml(head.dtype(), &picked, vec![ids.len(), cols], &Device::Cpu)?;
        Ok(Self { ids, head: Linear::on(Arc::new(t), compute)? })
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Logits of the listed tokens only, `(n, len)`, for normed hidden states `h (n, dim)`.
    pub fn small_logits(&self, h: &Tensor) -> Result<Tensor> {
        Ok(self.head.forward(h)?.to_dtype(candle_core::DType::F32)?)
    }

    /// Full-vocabulary logit rows for normed hidden states `h (n, dim)`: the listed tokens' logits, −∞ elsewhere.
    pub fn logits(&self, h: &Tensor, vocab_size: usize) -> Result<Vec<Vec<f32>>> {
        let small = self.small_logits(h)?.to_vec2::<f32>()?;
        Ok(small
            .into_iter()
            .map(|row| {
                let mut full = vec![f32::NEG_INFINITY; vocab_size];
                for (&t, v) in self.ids.iter().zip(row) {
                    full[t as usize] = v;
                }
                full
            })
            .collect())
    }
}
